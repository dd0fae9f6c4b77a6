// Per-layer cached state behind one small interface, so the reuse planner never
// asks what kind of model it serves (see mlx-lm's cache classes).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvchat/kv_buffer.h"

namespace kvchat {

enum class LayerKind { kAttention, kSlidingWindow, kRecurrent, kHybrid };

std::string to_string(LayerKind kind);

// Bytes of each distinct storage, keyed by its data pointer, so storage shared
// between views or sessions is counted once.
using StorageBytes = std::unordered_map<const void*, int64_t>;

void add_storage(const at::Tensor& tensor, StorageBytes* seen);
int64_t total_bytes(const StorageBytes& seen);

// True when no tensor holds a NaN or Inf; one fused reduction and one sync for
// all of them, since commit checks every layer each turn.
bool all_finite(const std::vector<at::Tensor>& tensors);

// What a state is besides its tensors: with them, enough to rebuild it
// (layer_state_from), as mlx-lm's caches pair `state` with `meta_state`. So
// persistence and the cache bridge never ask for a concrete class.
struct LayerMeta {
  LayerKind kind = LayerKind::kAttention;
  int64_t tokens = 0;   // num_tokens()
  int64_t tensors = 0;  // how many of tensors() belong to this state (or part)
  // A hybrid's parts in tensor order: its attention part (absent in a
  // snapshot) and then its recurrent part. Empty for the other kinds.
  std::vector<LayerMeta> parts;
};

class LayerState;
// Shared, never mutated after construction (pybind11 needs a non-const holder).
using LayerStatePtr = std::shared_ptr<LayerState>;

// Immutable: cropping returns a new state made of views, so a state handed to
// one session can never be changed by another (copy-on-write for free).
class LayerState {
 public:
  virtual ~LayerState() = default;
  virtual LayerKind kind() const = 0;
  // Tokens of the conversation this state has consumed.
  virtual int64_t num_tokens() const = 0;
  // Whether `cropped(n)` can give back the exact state after n tokens.
  virtual bool can_crop_to(int64_t n) const = 0;
  // The state after the first n tokens; throws if !can_crop_to(n).
  virtual LayerStatePtr cropped(int64_t n) const = 0;
  // A copy of what cropping could not give back later, owning its memory;
  // nullptr when cropping this state always returns here (full attention).
  virtual LayerStatePtr snapshot() const = 0;
  // What snapshot() keeps, sharing this state's storage where that is safe:
  // the adapter copies recurrent tensors into every cache it builds, so the
  // model never writes into a state the session holds. Costs no copy there.
  virtual LayerStatePtr shared_snapshot() const { return snapshot(); }
  // Whether restored(n, snapshot) works; snapshot may be null.
  virtual bool can_restore(int64_t n, const LayerState* snapshot) const;
  // The state after n tokens: cropped where it can be, otherwise taken from
  // `snapshot`, which snapshot() made at token n.
  virtual LayerStatePtr restored(int64_t n, const LayerStatePtr& snapshot) const;
  // The tensors, in the order the Python adapter expects for this kind (may
  // copy: a state on a shared prefix concatenates it).
  virtual std::vector<at::Tensor> tensors() const = 0;
  // The tensors (views) that hold positions >= begin: what a check of the
  // region new this turn must look at.
  virtual std::vector<at::Tensor> tensors_from(int64_t begin) const = 0;
  // True when no NaN/Inf was written for positions >= begin.
  bool finite_from(int64_t begin) const { return all_finite(tensors_from(begin)); }
  virtual void collect_storage(StorageBytes* seen) const;
  // A compact copy when this state pins much more storage than it uses (a KV
  // arena with room left over from decoding), so a session stores no more than
  // KvBuffer::grown_capacity of its tokens; nullptr when it is already compact.
  virtual LayerStatePtr without_slack() const { return nullptr; }
  virtual at::ScalarType dtype() const { return tensors().front().scalar_type(); }
  virtual at::Device device() const { return tensors().front().device(); }
  // With tensors(), what layer_state_from rebuilds this state from.
  virtual LayerMeta meta() const = 0;
  // The states a hybrid is made of, in tensor order (attention, when present,
  // then recurrent); empty for every other kind.
  virtual std::vector<LayerStatePtr> parts() const { return {}; }
};

// The state `meta` describes, made of `tensors` (as tensors() gave them).
// Throws ValueError naming what does not fit.
LayerStatePtr layer_state_from(const LayerMeta& meta, std::vector<at::Tensor> tensors);

// `layer` re-expressed on `base`, the same layer of a shared prefix, so it
// stops holding its own copy of the prefix; null when the kind has nothing to
// share (sliding windows, recurrent state) or it already sits on `base`. The
// caller vouches that layer's first tokens are base's.
LayerStatePtr on_shared_prefix(const LayerStatePtr& layer, const LayerStatePtr& base);

// Whether a shared prefix's layer state is still held by some session (a
// session rebased on a hybrid layer holds only its attention part).
bool held_elsewhere(const LayerStatePtr& state);

// Full attention: keys and values shaped [batch, kv_heads, tokens, head_dim].
// Crops to any length with a view. When the tensors are views of KV buffer
// arenas, the state remembers them, so the next turn can append in place.
//
// A state may also sit on a shared prefix (another session's system prompt,
// say): it then holds only the tokens after that prefix, and many sessions
// hold the prefix's storage once. Reading it whole means a copy (keys(),
// tensors(), buffer()), which a turn pays once when it builds its cache.
class AttentionState final : public LayerState {
 public:
  AttentionState(at::Tensor keys, at::Tensor values);
  // The tokens after `prefix` (a plain, unsegmented state); may be empty.
  AttentionState(std::shared_ptr<const AttentionState> prefix, at::Tensor keys, at::Tensor values);
  // The buffer's current keys and values, remembering its arenas.
  static std::shared_ptr<AttentionState> from_buffer(const KvBuffer& buffer);
  // `whole` re-expressed on `prefix`: its tokens after the prefix are copied
  // into compact tensors, so it stops pinning its own copy of the prefix. The
  // caller vouches that whole's first prefix tokens are the prefix's.
  static std::shared_ptr<AttentionState> on_prefix(std::shared_ptr<const AttentionState> prefix,
                                                   const AttentionState& whole);
  // A buffer that continues this state with room for `capacity` tokens: in
  // the remembered arenas when it still owns their tail, otherwise in fresh
  // ones (copy-on-write).
  KvBuffer buffer(int64_t capacity = 0) const;
  LayerKind kind() const override { return LayerKind::kAttention; }
  int64_t num_tokens() const override { return prefix_tokens() + keys_.size(2); }
  bool can_crop_to(int64_t n) const override { return n >= 0 && n <= num_tokens(); }
  LayerStatePtr cropped(int64_t n) const override;
  LayerStatePtr snapshot() const override { return nullptr; }
  std::vector<at::Tensor> tensors() const override { return {keys(), values()}; }
  std::vector<at::Tensor> tensors_from(int64_t begin) const override;
  void collect_storage(StorageBytes* seen) const override;
  LayerStatePtr without_slack() const override;
  at::ScalarType dtype() const override { return keys_.scalar_type(); }
  at::Device device() const override { return keys_.device(); }
  LayerMeta meta() const override { return {kind(), num_tokens(), 2, {}}; }
  // Whole keys / values; a concatenation (copy) when on a shared prefix.
  at::Tensor keys() const;
  at::Tensor values() const;
  const std::shared_ptr<const AttentionState>& prefix() const { return prefix_; }
  int64_t prefix_tokens() const { return prefix_ ? prefix_->num_tokens() : 0; }

 private:
  void check_tensors() const;

  std::shared_ptr<const AttentionState> prefix_;  // null unless on a shared prefix
  at::Tensor keys_;                               // the tokens after prefix_
  at::Tensor values_;
  KvArenaPtr key_arena_;    // null unless the tensors are views of an arena
  KvArenaPtr value_arena_;  // null unless the tensors are views of an arena
};

// An owning, compact copy of `state` (every kind), pinning no larger storage:
// what a shared prefix is made of.
LayerStatePtr compact_copy(const LayerState& state);

// Sliding-window attention: holds only the last keys.size(2) of num_tokens()
// tokens. Once it has dropped a token it cannot crop; a checkpoint must serve.
class SlidingWindowState final : public LayerState {
 public:
  SlidingWindowState(at::Tensor keys, at::Tensor values, int64_t total_tokens);
  LayerKind kind() const override { return LayerKind::kSlidingWindow; }
  int64_t num_tokens() const override { return total_tokens_; }
  int64_t held_tokens() const { return attention_.num_tokens(); }
  bool can_crop_to(int64_t n) const override;
  LayerStatePtr cropped(int64_t n) const override;
  // A compact copy of the held window (at most window - 1 tokens).
  LayerStatePtr snapshot() const override;
  std::vector<at::Tensor> tensors() const override { return attention_.tensors(); }
  std::vector<at::Tensor> tensors_from(int64_t begin) const override;
  void collect_storage(StorageBytes* seen) const override { attention_.collect_storage(seen); }
  LayerMeta meta() const override { return {kind(), num_tokens(), 2, {}}; }

 private:
  AttentionState attention_;  // the held tail, validated like full attention
  int64_t total_tokens_;
};

// Recurrent, conv or linear-attention state: a fixed-size summary of every
// token so far. It cannot crop at all; it is restored from checkpoints.
class RecurrentState final : public LayerState {
 public:
  RecurrentState(std::vector<at::Tensor> tensors, int64_t total_tokens);
  LayerKind kind() const override { return LayerKind::kRecurrent; }
  int64_t num_tokens() const override { return total_tokens_; }
  bool can_crop_to(int64_t n) const override { return n == total_tokens_; }
  LayerStatePtr cropped(int64_t n) const override;
  // Clones: the model updates these tensors in place on the next forward.
  LayerStatePtr snapshot() const override;
  LayerStatePtr shared_snapshot() const override;
  std::vector<at::Tensor> tensors() const override { return tensors_; }
  std::vector<at::Tensor> tensors_from(int64_t begin) const override;
  LayerMeta meta() const override {
    return {kind(), num_tokens(), static_cast<int64_t>(tensors_.size()), {}};
  }

 private:
  std::vector<at::Tensor> tensors_;
  int64_t total_tokens_;
};

// A layer holding attention KV beside a recurrent state (FalconH1's attention
// plus Mamba2). The KV crops; the recurrent part comes from checkpoints. Its
// snapshot keeps only what cannot crop, so attention may be null there.
class HybridState final : public LayerState {
 public:
  // attention: an attention or sliding-window state, or null in a snapshot;
  // recurrent: a recurrent state over the same tokens.
  HybridState(LayerStatePtr attention, LayerStatePtr recurrent);
  LayerKind kind() const override { return LayerKind::kHybrid; }
  int64_t num_tokens() const override { return recurrent_->num_tokens(); }
  bool can_crop_to(int64_t n) const override;
  LayerStatePtr cropped(int64_t n) const override;
  LayerStatePtr snapshot() const override;
  LayerStatePtr shared_snapshot() const override;
  bool can_restore(int64_t n, const LayerState* snapshot) const override;
  LayerStatePtr restored(int64_t n, const LayerStatePtr& snapshot) const override;
  std::vector<at::Tensor> tensors() const override;
  std::vector<at::Tensor> tensors_from(int64_t begin) const override;
  // Never through tensors(): that would concatenate a shared attention prefix.
  void collect_storage(StorageBytes* seen) const override;
  LayerStatePtr without_slack() const override;
  at::ScalarType dtype() const override;
  at::Device device() const override;
  LayerMeta meta() const override;
  std::vector<LayerStatePtr> parts() const override;
  const LayerStatePtr& attention() const { return attention_; }
  const LayerStatePtr& recurrent() const { return recurrent_; }

 private:
  LayerStatePtr attention_;
  LayerStatePtr recurrent_;
};

// Checks that all layers agree on token count, dtype and device; names the
// first offending layer in a ValueError.
void check_layers_consistent(const std::vector<LayerStatePtr>& layers, int64_t expected_tokens);

}  // namespace kvchat
