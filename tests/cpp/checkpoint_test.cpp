#include "kvchat/checkpoint.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace kvchat {
namespace {

using testing::attention_layer;
using testing::recurrent_layer;

// A hybrid model's checkpoint: nullptr for attention (it crops), a snapshot
// for the recurrent layer.
Checkpoint hybrid_checkpoint(int64_t position) {
  return Checkpoint{position, {nullptr, recurrent_layer(position)}};
}

std::vector<int64_t> positions(const std::vector<Checkpoint>& cps) {
  std::vector<int64_t> out;
  for (const auto& cp : cps) out.push_back(cp.position);
  return out;
}

TEST(Checkpoint, RestorableNeedsACheckpointForLayersThatCannotCrop) {
  std::vector<LayerStatePtr> layers = {attention_layer(20), recurrent_layer(20)};
  auto cp = hybrid_checkpoint(12);
  EXPECT_TRUE(restorable(layers, 20, nullptr));
  EXPECT_FALSE(restorable(layers, 12, nullptr));
  EXPECT_TRUE(restorable(layers, 12, &cp));
  EXPECT_FALSE(restorable(layers, 11, &cp));
}

TEST(CheckpointPositions, MessageEndsGenerationPromptAndLastPromptToken) {
  // ids: <s>=1 sys 9 <e>=2 \n=5 <s>=1 user 9 9 <e>=2 \n=5 [<s>=1 asst=7 \n=5] (generation prompt)
  const std::vector<int64_t> ids = {1, 9, 2, 5, 1, 9, 9, 2, 5, 1, 7, 5};
  const TurnMarkers markers{{2}, {{1, 7, 5}}};
  const auto n = static_cast<int64_t>(ids.size());
  // After each <e>, the generation prompt's start (9), and n - 1 = 11.
  EXPECT_EQ(checkpoint_positions(ids.data(), n, 0, markers), (std::vector<int64_t>{3, 8, 9, 11}));
  // Only positions after the cached prefix are new.
  EXPECT_EQ(checkpoint_positions(ids.data(), n, 8, markers), (std::vector<int64_t>{9, 11}));
  EXPECT_EQ(checkpoint_positions(ids.data(), n, 10, markers), (std::vector<int64_t>{11}));
  EXPECT_TRUE(checkpoint_positions(ids.data(), n, 11, markers).empty());
  EXPECT_THROW(checkpoint_positions(ids.data(), n, 12, markers), c10::IndexError);
}

TEST(CheckpointPositions, LastMessageStopsOnceAtTheFinalMessagesStartWhenFarEnough) {
  // <s>=1, <e>=2, \n=5: a system message of `system` tokens, then a user
  // message and the generation prompt [1 7 5].
  const TurnMarkers markers{{2}, {{1, 7, 5}}};
  auto prompt = [](int64_t system) {
    std::vector<int64_t> ids{1};
    ids.insert(ids.end(), system, 9);
    for (int64_t id : {2, 5, 1, 9, 9, 2, 5, 1, 7, 5}) ids.push_back(id);
    return ids;
  };
  const auto last = CheckpointPlacement::kLastMessage;
  auto ids = prompt(kMinCheckpointGap);
  auto n = static_cast<int64_t>(ids.size());
  const int64_t system_end = kMinCheckpointGap + 2;  // just after the system's <e>
  EXPECT_EQ(checkpoint_positions(ids.data(), n, 0, markers, last),
            (std::vector<int64_t>{system_end}));
  // Closer than the gap to the cache's end: the free checkpoint there serves.
  EXPECT_TRUE(checkpoint_positions(ids.data(), n, 3, markers, last).empty());
  // Past the final message's start: nothing left to stop at.
  EXPECT_TRUE(checkpoint_positions(ids.data(), n, system_end, markers, last).empty());
  ids = prompt(kMinCheckpointGap - 3);
  n = static_cast<int64_t>(ids.size());
  EXPECT_TRUE(checkpoint_positions(ids.data(), n, 0, markers, last).empty());
  // A single message (no end before the final one's) has no start to stop at.
  const std::vector<int64_t> alone{1, 9, 9, 9, 2, 5, 1, 7, 5};
  EXPECT_TRUE(checkpoint_positions(alone.data(), alone.size(), 0, markers, last).empty());
}

TEST(CheckpointPositions, ARewrittenTailAddsAStopWhereHistoryWillDiverge) {
  const TurnMarkers markers{{2}, {{1, 7, 5}}};
  const std::vector<int64_t> ids = {1, 9, 2, 5, 1, 9, 9, 2, 5, 1, 7, 5};
  const auto n = static_cast<int64_t>(ids.size());
  const auto last = CheckpointPlacement::kLastMessage;
  const auto every = CheckpointPlacement::kEveryMessage;
  // The template's generation prompt [1 7 5] is rendered otherwise in history.
  EXPECT_EQ(checkpoint_positions(ids.data(), n, 0, markers, last, 3), (std::vector<int64_t>{9}));
  EXPECT_EQ(checkpoint_positions(ids.data(), n, 0, markers, every, 3),
            (std::vector<int64_t>{3, 8, 9, 11}));
  EXPECT_EQ(checkpoint_positions(ids.data(), n, 0, markers, every, 2),
            (std::vector<int64_t>{3, 8, 9, 10, 11}));
  // Already cached past it, or a tail longer than the prompt: no stop.
  EXPECT_TRUE(checkpoint_positions(ids.data(), n, 9, markers, last, 3).empty());
  EXPECT_TRUE(checkpoint_positions(ids.data(), n, 0, markers, last, 40).empty());
  EXPECT_THROW(checkpoint_positions(ids.data(), n, 0, markers, last, -1), c10::ValueError);
}

TEST(Checkpoint, CheckNamesTheProblem) {
  EXPECT_THROW(check_checkpoint(hybrid_checkpoint(5), 3, 10), c10::ValueError);
  EXPECT_THROW(check_checkpoint(hybrid_checkpoint(11), 2, 10), c10::IndexError);
  Checkpoint wrong{5, {nullptr, recurrent_layer(4)}};
  EXPECT_THROW(check_checkpoint(wrong, 2, 10), c10::ValueError);
  EXPECT_NO_THROW(check_checkpoint(hybrid_checkpoint(5), 2, 10));
}

TEST(Checkpoint, MergeThinsTheCheapestAndKeepsTheHighest) {
  // A system prompt ending at 100, then a turn's cluster of message ends.
  std::vector<Checkpoint> kept = {hybrid_checkpoint(100), hybrid_checkpoint(101)};
  std::vector<Checkpoint> added = {hybrid_checkpoint(103), hybrid_checkpoint(101),
                                   hybrid_checkpoint(150), hybrid_checkpoint(152)};
  // Costs (gap below): 100, 1, 2, 47; 101 then 103 go, the system prompt stays.
  auto merged = merge_checkpoints(kept, added, CheckpointPolicy{3, 0});
  EXPECT_EQ(positions(merged), (std::vector<int64_t>{100, 150, 152}));
  // Costs 100 and 50: 150 goes; 152, the highest, never does.
  merged = merge_checkpoints(merged, {}, CheckpointPolicy{2, 0});
  EXPECT_EQ(positions(merged), (std::vector<int64_t>{100, 152}));
  merged = merge_checkpoints(merged, {}, CheckpointPolicy{1, 0});
  EXPECT_EQ(positions(merged), (std::vector<int64_t>{152}));
  EXPECT_TRUE(merge_checkpoints(merged, {}, CheckpointPolicy{0, 0}).empty());
}

TEST(Checkpoint, ThinningKeepsTheCheckpointTheNextTurnNeeds) {
  // A turn's checkpoints: its start (100), a template's rewritten generation
  // prompt (148) and the prompt's end (152). The next prompt departs at 150.
  const std::vector<Checkpoint> taken{hybrid_checkpoint(100), hybrid_checkpoint(148),
                                      hybrid_checkpoint(152)};
  auto merged = merge_checkpoints({}, taken, CheckpointPolicy{1, 0}, 150);
  EXPECT_EQ(positions(merged), (std::vector<int64_t>{148}));
  // Two: the needed one and the highest.
  merged = merge_checkpoints({}, taken, CheckpointPolicy{2, 0}, 150);
  EXPECT_EQ(positions(merged), (std::vector<int64_t>{148, 152}));
  // Needed at or past the highest, or nothing at or below it: the highest, as without a hint.
  EXPECT_EQ(positions(merge_checkpoints({}, taken, CheckpointPolicy{1, 0}, 400)),
            (std::vector<int64_t>{152}));
  EXPECT_EQ(positions(merge_checkpoints({}, taken, CheckpointPolicy{1, 0}, 50)),
            (std::vector<int64_t>{152}));
  // A byte bound that fits one keeps the needed one too.
  const int64_t one = checkpoint_bytes({hybrid_checkpoint(1)});
  EXPECT_EQ(positions(merge_checkpoints({}, taken, CheckpointPolicy{8, one}, 120)),
            (std::vector<int64_t>{100}));
}

TEST(Checkpoint, MergeRespectsTheByteBound) {
  const int64_t one = checkpoint_bytes({hybrid_checkpoint(1)});
  std::vector<Checkpoint> added;
  for (int64_t p = 1; p <= 6; ++p) added.push_back(hybrid_checkpoint(p));
  auto merged = merge_checkpoints({}, added, CheckpointPolicy{100, one * 2});
  EXPECT_EQ(merged.size(), 2u);
  EXPECT_EQ(merged.back().position, 6);
  EXPECT_LE(checkpoint_bytes(merged), one * 2);
  // A bound below one checkpoint keeps none rather than break the bound.
  EXPECT_TRUE(merge_checkpoints({}, added, CheckpointPolicy{100, one - 1}).empty());
}

}  // namespace
}  // namespace kvchat
