// Per-layer cached state behind one small interface, so the reuse planner never
// asks what kind of model it serves (see mlx-lm's cache classes).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace kvchat {

enum class LayerKind { kAttention, kSlidingWindow, kRecurrent };

std::string to_string(LayerKind kind);

// Bytes of each distinct storage, keyed by its data pointer, so storage shared
// between views or sessions is counted once.
using StorageBytes = std::unordered_map<const void*, int64_t>;

void add_storage(const at::Tensor& tensor, StorageBytes* seen);
int64_t total_bytes(const StorageBytes& seen);

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
  // The tensors, in the order the Python adapter expects for this kind.
  virtual std::vector<at::Tensor> tensors() const = 0;
  // True when no NaN/Inf was written for positions >= begin.
  virtual bool finite_from(int64_t begin) const = 0;
  void collect_storage(StorageBytes* seen) const;
  at::ScalarType dtype() const { return tensors().front().scalar_type(); }
  at::Device device() const { return tensors().front().device(); }
};

// Full attention: keys and values shaped [batch, kv_heads, tokens, head_dim].
// Crops to any length with a view.
class AttentionState final : public LayerState {
 public:
  AttentionState(at::Tensor keys, at::Tensor values);
  LayerKind kind() const override { return LayerKind::kAttention; }
  int64_t num_tokens() const override { return keys_.size(2); }
  bool can_crop_to(int64_t n) const override { return n >= 0 && n <= num_tokens(); }
  LayerStatePtr cropped(int64_t n) const override;
  std::vector<at::Tensor> tensors() const override { return {keys_, values_}; }
  bool finite_from(int64_t begin) const override;
  const at::Tensor& keys() const { return keys_; }
  const at::Tensor& values() const { return values_; }

 private:
  at::Tensor keys_;
  at::Tensor values_;
};

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
  std::vector<at::Tensor> tensors() const override { return attention_.tensors(); }
  bool finite_from(int64_t begin) const override;

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
  std::vector<at::Tensor> tensors() const override { return tensors_; }
  bool finite_from(int64_t begin) const override;

 private:
  std::vector<at::Tensor> tensors_;
  int64_t total_tokens_;
};

// Checks that all layers agree on token count, dtype and device; names the
// first offending layer in a ValueError.
void check_layers_consistent(const std::vector<LayerStatePtr>& layers, int64_t expected_tokens);

}  // namespace kvchat
