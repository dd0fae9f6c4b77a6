#include "kvchat/turn_checks.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

namespace kvchat {
namespace {

// A ChatML-like stream: 1 = <|im_start|>, 2 = <|im_end|>, 3 = "assistant", 4 = "\n".
const TurnMarkers kMarkers{{2}, {{1, 3, 4}}};

TEST(FindTurnBoundaries, AfterEndOfTurnAndAtRoleHeaders) {
  //                          0   1   2  3  4  5  6  7  8
  std::vector<int64_t> ids = {1, 50, 51, 2, 4, 1, 3, 4, 60};
  auto found = find_turn_boundaries(ids.data(), 9, 0, 9, kMarkers);
  EXPECT_EQ(found, (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(last_turn_boundary(ids.data(), 9, 8, kMarkers), 5);
  EXPECT_EQ(last_turn_boundary(ids.data(), 9, 3, kMarkers), 0);
}

TEST(FindTurnBoundaries, RangeIsChecked) {
  std::vector<int64_t> ids = {1, 2};
  EXPECT_THROW(find_turn_boundaries(ids.data(), 2, 0, 3, kMarkers), c10::IndexError);
}

TEST(CheckMarkers, RejectsEmptyHeaderAndNegativeIds) {
  EXPECT_THROW(check_markers(TurnMarkers{{2}, {{}}}), c10::ValueError);
  EXPECT_THROW(check_markers(TurnMarkers{{-1}, {}}), c10::ValueError);
}

TEST(FindRepetitionLoop, FindsALongLoopAtTheTail) {
  std::vector<int64_t> ids = {9, 8, 7};
  for (int i = 0; i < 40; ++i) {
    ids.push_back(5);
    ids.push_back(6);
  }
  RepetitionRule rule{8, 64};
  EXPECT_EQ(find_repetition_loop(ids.data(), 0, ids.size(), rule), 3);
}

TEST(FindRepetitionLoop, IgnoresShortLoopsAndVariedText) {
  std::vector<int64_t> ids;
  for (int i = 0; i < 100; ++i) ids.push_back(i % 37 == 0 ? 1 : 1000 + i);
  RepetitionRule rule{8, 64};
  EXPECT_EQ(find_repetition_loop(ids.data(), 0, ids.size(), rule), -1);
  std::vector<int64_t> short_loop(20, 7);
  EXPECT_EQ(find_repetition_loop(short_loop.data(), 0, 20, rule), -1);
}

TEST(FindRepetitionLoop, LooksOnlyInsideTheNewRegion) {
  // A long loop in old history, then a varied new region: nothing is flagged.
  std::vector<int64_t> ids(100, 7);
  for (int i = 0; i < 30; ++i) ids.push_back(200 + i);
  RepetitionRule rule{8, 64};
  EXPECT_EQ(find_repetition_loop(ids.data(), 100, ids.size(), rule), -1);
  EXPECT_EQ(find_repetition_loop(ids.data(), 0, 100, rule), 0);
}

}  // namespace
}  // namespace kvchat
