#include "kvchat/kv_buffer.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "kvchat/layer_state.h"

namespace kvchat {
namespace {

// n tokens whose values are `first`, first + 1, ...: [1, 2, n, 3].
at::Tensor tokens(int64_t n, double first) {
  return (at::arange(n, at::kFloat) + first).view({1, 1, n, 1}).expand({1, 2, n, 3}).contiguous();
}

float at_position(const at::Tensor& kv, int64_t pos) { return kv[0][0][pos][0].item<float>(); }

TEST(KvBuffer, AppendsInPlaceWithinCapacityAndReturnsViews) {
  auto buffer = KvBuffer::empty_like(tokens(1, 0), tokens(1, 0), 8);
  buffer.append(tokens(3, 0), tokens(3, 100));
  const void* storage = buffer.keys().data_ptr();
  for (int i = 3; i < 8; ++i) buffer.append(tokens(1, i), tokens(1, 100 + i));
  EXPECT_EQ(buffer.length(), 8);
  EXPECT_EQ(buffer.keys().data_ptr(), storage);  // no reallocation, no copy of the prefix
  EXPECT_EQ(buffer.reallocations(), 0);
  EXPECT_FLOAT_EQ(at_position(buffer.keys(), 7), 7.0f);
  EXPECT_FLOAT_EQ(at_position(buffer.values(), 5), 105.0f);
}

TEST(KvBuffer, GrowsGeometricallySoDecodingCopiesRarely) {
  auto buffer = KvBuffer(tokens(4, 0), tokens(4, 0));  // adopted: full, no room
  for (int i = 4; i < 1000; ++i) buffer.append(tokens(1, i), tokens(1, i));
  EXPECT_EQ(buffer.length(), 1000);
  // A quarter more each time: 16 copies for 1000 tokens, and never more than
  // a quarter of unused room (the first steps at least 16 tokens).
  EXPECT_LE(buffer.reallocations(), 16);
  EXPECT_LE(buffer.capacity(), KvBuffer::grown_capacity(1000));
  EXPECT_FLOAT_EQ(at_position(buffer.keys(), 999), 999.0f);
  EXPECT_FLOAT_EQ(at_position(buffer.keys(), 2), 2.0f);
}

TEST(KvBuffer, ReserveMakesLaterAppendsAllocationFree) {
  auto buffer = KvBuffer(tokens(10, 0), tokens(10, 0));
  buffer.reserve(50);
  EXPECT_EQ(buffer.reallocations(), 1);
  for (int i = 10; i < 50; ++i) buffer.append(tokens(1, i), tokens(1, i));
  EXPECT_EQ(buffer.reallocations(), 1);
}

TEST(KvBuffer, AnAppendNeverChangesWhatAnotherHolderSees) {
  auto first = KvBuffer::empty_like(tokens(1, 0), tokens(1, 0), 64);
  first.append(tokens(10, 0), tokens(10, 0));
  // A session keeps the first 10 tokens; two later turns branch from token 6.
  auto kept = AttentionState::from_buffer(first);
  auto branch_a = std::static_pointer_cast<AttentionState>(kept->cropped(6))->buffer();
  auto branch_b = std::static_pointer_cast<AttentionState>(kept->cropped(6))->buffer();
  branch_a.append(tokens(2, 500), tokens(2, 500));
  branch_b.append(tokens(2, 900), tokens(2, 900));
  EXPECT_FLOAT_EQ(at_position(kept->keys(), 6), 6.0f);  // untouched
  EXPECT_FLOAT_EQ(at_position(branch_a.keys(), 6), 500.0f);
  EXPECT_FLOAT_EQ(at_position(branch_b.keys(), 6), 900.0f);
  EXPECT_EQ(branch_a.reallocations(), 1);  // copy-on-write: the arena's tail was taken

  // The owner of the tail extends in place: the next turn of the same session.
  auto next = kept->buffer();
  next.append(tokens(1, 10), tokens(1, 10));
  EXPECT_EQ(next.reallocations(), 0);
  EXPECT_EQ(next.keys().data_ptr(), kept->keys().data_ptr());
}

TEST(KvBuffer, CropKeepsDataForOtherHoldersAndNamesBadInput) {
  auto buffer = KvBuffer::empty_like(tokens(1, 0), tokens(1, 0), 16);
  buffer.append(tokens(8, 0), tokens(8, 0));
  auto held = buffer.keys();
  buffer.crop(5);
  buffer.append(tokens(1, 42), tokens(1, 42));  // position 5 was written: copy
  EXPECT_FLOAT_EQ(at_position(held, 5), 5.0f);
  EXPECT_FLOAT_EQ(at_position(buffer.keys(), 5), 42.0f);
  EXPECT_THROW(buffer.crop(7), c10::IndexError);
  EXPECT_THROW(buffer.append(at::zeros({1, 3, 1, 3}), at::zeros({1, 3, 1, 3})), c10::ValueError);
  EXPECT_THROW(buffer.append(tokens(1, 0).to(at::kDouble), tokens(1, 0).to(at::kDouble)),
               c10::ValueError);
  EXPECT_THROW(KvBuffer(at::zeros({2, 3}), at::zeros({2, 3})), c10::ValueError);
}

}  // namespace
}  // namespace kvchat
