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

TEST(LayerSnapshot, AttentionNeedsNoneAndOthersOwnTheirMemory) {
  EXPECT_EQ(testing::attention_layer(5)->snapshot(), nullptr);

  auto recurrent = testing::recurrent_layer(7);
  auto snap = recurrent->snapshot();
  ASSERT_NE(snap, nullptr);
  EXPECT_EQ(snap->num_tokens(), 7);
  // The model writes recurrent tensors in place; the snapshot must not see it.
  recurrent->tensors()[0].fill_(-1.0);
  EXPECT_FLOAT_EQ(snap->tensors()[0].view(-1)[0].item<float>(), 7.0f);

  auto buffer = at::zeros({1, 2, 40, 4});
  SlidingWindowState window(buffer.narrow(2, 30, 10), buffer.narrow(2, 30, 10), 50);
  auto compact = window.snapshot();
  EXPECT_EQ(compact->num_tokens(), 50);
  StorageBytes seen;
  compact->collect_storage(&seen);
  EXPECT_EQ(total_bytes(seen), 2 * 10 * 2 * 4 * 4);  // the window only, not the buffer
}

TEST(LayerSnapshot, RestoredCropsWhenItCanAndOtherwiseNeedsASnapshotFromThatToken) {
  auto attention = testing::attention_layer(9);
  EXPECT_TRUE(attention->can_restore(4, nullptr));
  EXPECT_EQ(attention->restored(4, nullptr)->num_tokens(), 4);

  auto recurrent = testing::recurrent_layer(9);
  LayerStatePtr at4 = testing::recurrent_layer(4);
  LayerStatePtr at5 = testing::recurrent_layer(5);
  EXPECT_FALSE(recurrent->can_restore(4, nullptr));
  EXPECT_FALSE(recurrent->can_restore(4, at5.get()));
  EXPECT_FALSE(recurrent->can_restore(4, attention.get()));  // wrong kind
  EXPECT_TRUE(recurrent->can_restore(4, at4.get()));
  EXPECT_EQ(recurrent->restored(4, at4), at4);
  EXPECT_THROW(recurrent->restored(4, at5), c10::IndexError);
}

TEST(HybridState, CropsItsKvAndTakesOnlyTheRecurrentPartFromTheSnapshot) {
  HybridState live(testing::attention_layer(12), testing::recurrent_layer(12));
  EXPECT_EQ(live.kind(), LayerKind::kHybrid);
  EXPECT_TRUE(live.can_crop_to(12));
  EXPECT_FALSE(live.can_crop_to(8));
  EXPECT_EQ(live.tensors().size(), 3u);  // keys, values, one recurrent tensor

  // A snapshot of a hybrid with full attention holds no KV at all.
  HybridState at8(testing::attention_layer(8), testing::recurrent_layer(8));
  auto snap = at8.snapshot();
  const auto& snap_hybrid = static_cast<const HybridState&>(*snap);
  EXPECT_EQ(snap_hybrid.attention(), nullptr);
  EXPECT_EQ(snap->tensors().size(), 1u);

  ASSERT_TRUE(live.can_restore(8, snap.get()));
  EXPECT_FALSE(live.can_restore(7, snap.get()));
  auto back = std::static_pointer_cast<HybridState>(live.restored(8, snap));
  EXPECT_EQ(back->num_tokens(), 8);
  // KV is a view of the live storage; the recurrent part is the snapshot's.
  EXPECT_EQ(back->attention()->tensors()[0].data_ptr(), live.attention()->tensors()[0].data_ptr());
  EXPECT_EQ(back->recurrent(), snap_hybrid.recurrent());
}

TEST(HybridState, RejectsMismatchedParts) {
  EXPECT_THROW(HybridState(testing::attention_layer(4), testing::recurrent_layer(5)),
               c10::ValueError);
  EXPECT_THROW(HybridState(testing::attention_layer(4), testing::attention_layer(4)),
               c10::ValueError);
  EXPECT_THROW(HybridState(testing::recurrent_layer(4), testing::recurrent_layer(4)),
               c10::ValueError);
  EXPECT_THROW(HybridState(nullptr, nullptr), c10::ValueError);
  // A snapshot lacks the KV, so it can never be a session's live state.
  std::vector<LayerStatePtr> layers = {
      std::make_shared<HybridState>(nullptr, testing::recurrent_layer(4))};
  EXPECT_THROW(check_layers_consistent(layers, 4), c10::ValueError);
}

TEST(CheckLayersConsistent, RecurrentStatesMayUseAWiderDtype) {
  std::vector<LayerStatePtr> layers = {
      testing::attention_layer(4),
      std::make_shared<RecurrentState>(std::vector<at::Tensor>{at::zeros({1, 2}, at::kDouble)}, 4)};
  EXPECT_NO_THROW(check_layers_consistent(layers, 4));
}

// Every kind rebuilds from its meta and tensors alone (what a session file holds).
void expect_round_trip(const LayerStatePtr& state) {
  auto rebuilt = layer_state_from(state->meta(), state->tensors());
  EXPECT_EQ(rebuilt->kind(), state->kind());
  EXPECT_EQ(rebuilt->num_tokens(), state->num_tokens());
  const auto a = state->tensors(), b = rebuilt->tensors();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(at::equal(a[i], b[i]));
  EXPECT_EQ(rebuilt->parts().size(), state->parts().size());
}

TEST(LayerMeta, EveryKindRebuildsFromItsMetaAndTensors) {
  auto window =
      std::make_shared<SlidingWindowState>(at::ones({1, 2, 4, 3}), at::zeros({1, 2, 4, 3}), 9);
  auto hybrid =
      std::make_shared<HybridState>(testing::attention_layer(7), testing::recurrent_layer(7));
  expect_round_trip(testing::attention_layer(5));
  expect_round_trip(window);
  expect_round_trip(testing::recurrent_layer(6));
  expect_round_trip(hybrid);
  expect_round_trip(hybrid->snapshot());  // attention snapshot is empty: one part

  const auto meta = hybrid->meta();
  EXPECT_EQ(meta.tensors, 3);
  ASSERT_EQ(meta.parts.size(), 2u);
  EXPECT_EQ(meta.parts[0].kind, LayerKind::kAttention);
  EXPECT_EQ(meta.parts[1].kind, LayerKind::kRecurrent);
  EXPECT_EQ(window->meta().tokens, 9);
}

TEST(LayerMeta, RefusesMetaThatDoesNotFitTheTensors) {
  auto attention = testing::attention_layer(5);
  auto meta = attention->meta();
  meta.tokens = 6;
  EXPECT_THROW(layer_state_from(meta, attention->tensors()), c10::ValueError);
  meta = attention->meta();
  meta.tensors = 3;
  EXPECT_THROW(layer_state_from(meta, attention->tensors()), c10::ValueError);
  auto hybrid =
      std::make_shared<HybridState>(testing::attention_layer(7), testing::recurrent_layer(7));
  meta = hybrid->meta();
  meta.parts[1].tokens = 3;
  EXPECT_THROW(layer_state_from(meta, hybrid->tensors()), c10::ValueError);
  meta = hybrid->meta();
  meta.parts[0].tensors = 3;  // parts claim more than there are
  EXPECT_THROW(layer_state_from(meta, hybrid->tensors()), c10::ValueError);
  meta = hybrid->meta();
  std::swap(meta.parts[0], meta.parts[1]);  // recurrent must come last
  EXPECT_THROW(layer_state_from(meta, hybrid->tensors()), c10::ValueError);
}

}  // namespace
}  // namespace kvchat
