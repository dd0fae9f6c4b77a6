#include "kvchat/kv_buffer.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace kvchat {

namespace {

void check_kv(const at::Tensor& keys, const at::Tensor& values, const char* what) {
  TORCH_CHECK_VALUE(keys.defined() && values.defined(), what, ": keys and values must be tensors");
  TORCH_CHECK_VALUE(keys.dim() == 4 && keys.size(0) == 1, what,
                    ": keys must be [1, heads, tokens, head_dim], got ", keys.sizes());
  TORCH_CHECK_VALUE(values.dim() == 4 && values.size(0) == 1 && values.size(1) == keys.size(1) &&
                        values.size(2) == keys.size(2),
                    what, ": values ", values.sizes(), " do not match keys ", keys.sizes());
}

at::Tensor arena_like(const at::Tensor& like, int64_t capacity) {
  return at::empty({1, like.size(1), capacity, like.size(3)}, like.options());
}

}  // namespace

KvArena::KvArena(at::Tensor storage, int64_t committed)
    : storage_(std::move(storage)), committed_(committed) {
  TORCH_CHECK_VALUE(storage_.dim() == 4, "arena storage must be 4-D, got ", storage_.sizes());
  TORCH_CHECK_VALUE(committed >= 0 && committed <= storage_.size(2), "committed ", committed,
                    " is outside the arena's ", storage_.size(2), " positions");
}

bool KvArena::claim(int64_t from, int64_t n) {
  if (from + n > capacity()) return false;
  int64_t expected = from;
  return committed_.compare_exchange_strong(expected, from + n);
}

KvBuffer::KvBuffer(const at::Tensor& keys, const at::Tensor& values) {
  check_kv(keys, values, "KvBuffer");
  length_ = keys.size(2);
  // Adopted tensors may be views someone else extends; a full arena with no
  // room forces the first append to copy, so adoption itself never copies.
  keys_ = std::make_shared<KvArena>(keys, length_);
  values_ = std::make_shared<KvArena>(values, length_);
}

KvBuffer::KvBuffer(KvArenaPtr keys, KvArenaPtr values, int64_t length)
    : keys_(std::move(keys)), values_(std::move(values)), length_(length) {
  TORCH_CHECK_VALUE(keys_ && values_, "KvBuffer needs both arenas");
  TORCH_CHECK_INDEX(
      length_ >= 0 && length_ <= keys_->committed() && length_ <= values_->committed(),
      "KvBuffer length ", length_, " is past what the arenas hold (", keys_->committed(), ")");
}

KvBuffer KvBuffer::empty_like(const at::Tensor& keys, const at::Tensor& values, int64_t capacity) {
  check_kv(keys, values, "KvBuffer.empty_like");
  TORCH_CHECK_VALUE(capacity >= 0, "capacity must be >= 0, got ", capacity);
  return KvBuffer(std::make_shared<KvArena>(arena_like(keys, capacity), 0),
                  std::make_shared<KvArena>(arena_like(values, capacity), 0), 0);
}

void KvBuffer::move_to_new_arenas(int64_t capacity) {
  auto keys = arena_like(keys_->storage(), capacity);
  auto values = arena_like(values_->storage(), capacity);
  keys.narrow(2, 0, length_).copy_(this->keys());
  values.narrow(2, 0, length_).copy_(this->values());
  keys_ = std::make_shared<KvArena>(std::move(keys), length_);
  values_ = std::make_shared<KvArena>(std::move(values), length_);
  reallocations_ += 1;
}

int64_t KvBuffer::grown_capacity(int64_t needed) {
  return needed + std::max<int64_t>(16, needed / 4);
}

void KvBuffer::reserve(int64_t total_tokens) {
  TORCH_CHECK_VALUE(total_tokens >= 0, "total_tokens must be >= 0, got ", total_tokens);
  const bool owns_tail = keys_->committed() == length_ && values_->committed() == length_;
  if (owns_tail && total_tokens <= capacity()) return;
  // Exactly what the turn needs: a session holds no headroom between turns,
  // at the price of one copy of its KV when a turn outgrows the arena.
  move_to_new_arenas(std::max(total_tokens, length_));
}

void KvBuffer::append(const at::Tensor& keys, const at::Tensor& values) {
  check_kv(keys, values, "KvBuffer.append");
  const auto& like = keys_->storage();
  TORCH_CHECK_VALUE(keys.size(1) == like.size(1) && keys.size(3) == like.size(3) &&
                        keys.scalar_type() == like.scalar_type() && keys.device() == like.device(),
                    "KvBuffer.append: keys ", keys.sizes(), " ", keys.scalar_type(), " on ",
                    keys.device(), " do not match the buffer's ", like.sizes(), " ",
                    like.scalar_type(), " on ", like.device());
  const int64_t n = keys.size(2);
  // Keys first, then values: whoever wins the keys' tail owns the values' too.
  if (!(keys_->claim(length_, n) && values_->claim(length_, n))) {
    move_to_new_arenas(grown_capacity(length_ + n));
    TORCH_INTERNAL_ASSERT(keys_->claim(length_, n) && values_->claim(length_, n));
  }
  keys_->storage().narrow(2, length_, n).copy_(keys);
  values_->storage().narrow(2, length_, n).copy_(values);
  length_ += n;
}

void KvBuffer::crop(int64_t length) {
  TORCH_CHECK_INDEX(length >= 0 && length <= length_, "cannot crop a KV buffer of ", length_,
                    " tokens to ", length);
  length_ = length;
}

at::Tensor KvBuffer::keys() const { return keys_->storage().narrow(2, 0, length_); }
at::Tensor KvBuffer::values() const { return values_->storage().narrow(2, 0, length_); }

}  // namespace kvchat
