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

TEST(Checkpoint, CheckNamesTheProblem) {
  EXPECT_THROW(check_checkpoint(hybrid_checkpoint(5), 3, 10), c10::ValueError);
  EXPECT_THROW(check_checkpoint(hybrid_checkpoint(11), 2, 10), c10::IndexError);
  Checkpoint wrong{5, {nullptr, recurrent_layer(4)}};
  EXPECT_THROW(check_checkpoint(wrong, 2, 10), c10::ValueError);
  EXPECT_NO_THROW(check_checkpoint(hybrid_checkpoint(5), 2, 10));
}

TEST(Checkpoint, MergeKeepsTheHighestPositionsWithinTheCount) {
  std::vector<Checkpoint> kept = {hybrid_checkpoint(3), hybrid_checkpoint(9)};
  std::vector<Checkpoint> added = {hybrid_checkpoint(15), hybrid_checkpoint(9),
                                   hybrid_checkpoint(20)};
  auto merged = merge_checkpoints(kept, added, CheckpointPolicy{3, 0});
  EXPECT_EQ(positions(merged), (std::vector<int64_t>{9, 15, 20}));
}

TEST(Checkpoint, MergeRespectsTheByteBound) {
  const int64_t one = checkpoint_bytes({hybrid_checkpoint(1)});
  std::vector<Checkpoint> added;
  for (int64_t p = 1; p <= 6; ++p) added.push_back(hybrid_checkpoint(p));
  auto merged = merge_checkpoints({}, added, CheckpointPolicy{100, one * 2});
  EXPECT_EQ(positions(merged), (std::vector<int64_t>{5, 6}));
  EXPECT_LE(checkpoint_bytes(merged), one * 2);
}

}  // namespace
}  // namespace kvchat
