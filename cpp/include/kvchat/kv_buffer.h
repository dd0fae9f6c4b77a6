// A growable KV buffer for decoding: appends in place with amortized growth
// and hands out views, where transformers' DynamicLayer concatenates (copies
// the whole layer) on every token.
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <cstdint>
#include <memory>

namespace kvchat {

// Append-only storage for one tensor of one layer, [1, heads, capacity, dim].
// Positions below `committed` are never written again, so every view of them
// stays valid for as long as anyone holds it. Only a writer whose length equals
// `committed` may extend in place; anyone else copies first (copy-on-write).
class KvArena {
 public:
  KvArena(at::Tensor storage, int64_t committed);
  const at::Tensor& storage() const { return storage_; }
  int64_t capacity() const { return storage_.size(2); }
  int64_t committed() const { return committed_.load(); }
  // Claims positions [from, from + n) for one writer. False when someone has
  // already written at or past `from`, or the arena has no room.
  bool claim(int64_t from, int64_t n);

 private:
  at::Tensor storage_;
  std::atomic<int64_t> committed_;
};

using KvArenaPtr = std::shared_ptr<KvArena>;

// One attention layer's keys and values: the first length() positions of two
// arenas. Not thread-safe itself; arenas may be shared between buffers.
class KvBuffer {
 public:
  // Adopts keys and values ([1, heads, tokens, dim]) without copying.
  KvBuffer(const at::Tensor& keys, const at::Tensor& values);
  // Continues arenas at `length` (for example a session's cached prefix).
  KvBuffer(KvArenaPtr keys, KvArenaPtr values, int64_t length);
  // An empty buffer shaped like `keys`/`values` with room for `capacity` tokens.
  static KvBuffer empty_like(const at::Tensor& keys, const at::Tensor& values, int64_t capacity);

  // The capacity a buffer that must hold `needed` tokens grows to: a quarter
  // more (at least 16), so appends copy the buffer O(log) times in all while
  // an idle session never holds more than that much unused room.
  static int64_t grown_capacity(int64_t needed);

  // Makes room for `total_tokens` so later appends up to it never reallocate.
  void reserve(int64_t total_tokens);
  // Writes keys/values ([1, heads, n, dim]) after the current length: in place
  // when this buffer owns the arenas' tail, otherwise into fresh arenas of
  // grown_capacity.
  void append(const at::Tensor& keys, const at::Tensor& values);
  // Shortens the buffer; the arenas keep their data for other holders.
  void crop(int64_t length);

  int64_t length() const { return length_; }
  int64_t capacity() const { return keys_->capacity(); }
  at::Tensor keys() const;    // a view of the first length() positions
  at::Tensor values() const;  // a view of the first length() positions
  const KvArenaPtr& key_arena() const { return keys_; }
  const KvArenaPtr& value_arena() const { return values_; }
  int64_t reallocations() const { return reallocations_; }

 private:
  void move_to_new_arenas(int64_t capacity);

  KvArenaPtr keys_;
  KvArenaPtr values_;
  int64_t length_ = 0;
  int64_t reallocations_ = 0;
};

}  // namespace kvchat
