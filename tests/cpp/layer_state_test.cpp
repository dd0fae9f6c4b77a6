#include "kvchat/layer_state.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace kvchat {
namespace {

TEST(AttentionState, CropIsAViewOfTheSameStorage) {
  auto layer = testing::attention_layer(10);
  auto cropped = layer->cropped(4);
  EXPECT_EQ(cropped->num_tokens(), 4);
  auto k = cropped->tensors()[0];
  EXPECT_EQ(k.data_ptr(), layer->keys().data_ptr());
  EXPECT_EQ(k.size(2), 4);
  EXPECT_FLOAT_EQ(k[0][0][3][0].item<float>(), 3.0f);
}

TEST(AttentionState, CanCropToAnyLengthWithinIt) {
  auto layer = testing::attention_layer(5);
  EXPECT_TRUE(layer->can_crop_to(0));
  EXPECT_TRUE(layer->can_crop_to(5));
  EXPECT_FALSE(layer->can_crop_to(6));
  EXPECT_FALSE(layer->can_crop_to(-1));
  EXPECT_THROW(layer->cropped(6), c10::IndexError);
}

TEST(AttentionState, RejectsMalformedTensors) {
  auto ok = at::zeros({1, 2, 3, 4});
  EXPECT_THROW(AttentionState(at::zeros({2, 3, 4}), ok), c10::ValueError);
  EXPECT_THROW(AttentionState(ok, at::zeros({1, 2, 5, 4})), c10::ValueError);
  EXPECT_THROW(AttentionState(ok, at::zeros({1, 2, 3, 4}, at::kDouble)), c10::ValueError);
  EXPECT_THROW(AttentionState(at::zeros({2, 2, 3, 4}), at::zeros({2, 2, 3, 4})), c10::ValueError);
  EXPECT_THROW(
      AttentionState(at::zeros({1, 2, 3, 4}, at::kLong), at::zeros({1, 2, 3, 4}, at::kLong)),
      c10::ValueError);
}

TEST(AttentionState, FiniteFromLooksOnlyAtTheTail) {
  auto keys = at::zeros({1, 1, 6, 2});
  keys[0][0][1][0] = std::numeric_limits<float>::quiet_NaN();
  AttentionState layer(keys, at::zeros({1, 1, 6, 2}));
  EXPECT_FALSE(layer.finite_from(0));
  EXPECT_TRUE(layer.finite_from(2));
  EXPECT_TRUE(layer.finite_from(6));
}

TEST(StorageBytes, SharedStorageCountsOnce) {
  auto layer = testing::attention_layer(8);
  StorageBytes seen;
  layer->collect_storage(&seen);
  layer->cropped(3)->collect_storage(&seen);
  const int64_t one_copy = 2 * 8 * 2 * 4 * static_cast<int64_t>(sizeof(float));
  EXPECT_EQ(total_bytes(seen), one_copy);
}

TEST(CheckLayersConsistent, NamesTheOffendingLayer) {
  std::vector<LayerStatePtr> layers = {testing::attention_layer(4), testing::attention_layer(3)};
  try {
    check_layers_consistent(layers, 4);
    FAIL() << "expected ValueError";
  } catch (const c10::ValueError& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("layer 1 holds 3 tokens"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace kvchat

namespace kvchat {
namespace {

TEST(SlidingWindowState, CropsOnlyWhileNothingHasSlidOut) {
  auto kv = at::zeros({1, 2, 6, 4});
  SlidingWindowState young(kv, kv, 6);  // holds all 6 tokens
  EXPECT_TRUE(young.can_crop_to(3));
  EXPECT_EQ(young.cropped(3)->num_tokens(), 3);
  SlidingWindowState full(kv, kv, 20);  // holds the last 6 of 20
  EXPECT_TRUE(full.can_crop_to(20));
  EXPECT_FALSE(full.can_crop_to(19));
  EXPECT_FALSE(full.can_crop_to(3));
  EXPECT_THROW(full.cropped(19), c10::IndexError);
  EXPECT_THROW(SlidingWindowState(kv, kv, 5), c10::ValueError);
}

TEST(SlidingWindowState, FiniteFromMapsPositionsIntoTheHeldTail) {
  auto keys = at::zeros({1, 1, 4, 2});
  keys[0][0][0][0] = std::numeric_limits<float>::quiet_NaN();  // position 16 of 20
  SlidingWindowState layer(keys, at::zeros({1, 1, 4, 2}), 20);
  EXPECT_FALSE(layer.finite_from(16));
  EXPECT_TRUE(layer.finite_from(17));
}

TEST(RecurrentState, NeverCropsBackward) {
  auto layer = testing::recurrent_layer(10);
  EXPECT_TRUE(layer->can_crop_to(10));
  EXPECT_FALSE(layer->can_crop_to(9));
  EXPECT_FALSE(layer->can_crop_to(0));
  EXPECT_THROW(layer->cropped(4), c10::IndexError);
  EXPECT_EQ(layer->kind(), LayerKind::kRecurrent);
  EXPECT_THROW(RecurrentState({}, 3), c10::ValueError);
  EXPECT_THROW(RecurrentState({at::zeros({2, 3})}, 3), c10::ValueError);
}

TEST(CheckLayersConsistent, RecurrentStatesMayUseAWiderDtype) {
  std::vector<LayerStatePtr> layers = {
      testing::attention_layer(4),
      std::make_shared<RecurrentState>(std::vector<at::Tensor>{at::zeros({1, 2}, at::kDouble)}, 4)};
  EXPECT_NO_THROW(check_layers_consistent(layers, 4));
}

}  // namespace
}  // namespace kvchat
