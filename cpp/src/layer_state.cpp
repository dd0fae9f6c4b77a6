#include "kvchat/layer_state.h"

#include <c10/util/Exception.h>

namespace kvchat {

std::string to_string(LayerKind kind) {
  switch (kind) {
    case LayerKind::kAttention:
      return "attention";
    case LayerKind::kSlidingWindow:
      return "sliding_window";
    case LayerKind::kRecurrent:
      return "recurrent";
  }
  return "unknown";
}

void add_storage(const at::Tensor& tensor, StorageBytes* seen) {
  if (!tensor.defined() || !tensor.has_storage()) return;
  const auto& storage = tensor.storage();
  (*seen)[storage.data()] = static_cast<int64_t>(storage.nbytes());
}

int64_t total_bytes(const StorageBytes& seen) {
  int64_t total = 0;
  for (const auto& [ptr, bytes] : seen) total += bytes;
  return total;
}

void LayerState::collect_storage(StorageBytes* seen) const {
  for (const auto& t : tensors()) add_storage(t, seen);
}

AttentionState::AttentionState(at::Tensor keys, at::Tensor values)
    : keys_(std::move(keys)), values_(std::move(values)) {
  TORCH_CHECK_VALUE(keys_.defined() && values_.defined(), "keys and values must be tensors");
  TORCH_CHECK_VALUE(keys_.dim() == 4, "keys must be [batch, kv_heads, tokens, head_dim], got ",
                    keys_.sizes());
  TORCH_CHECK_VALUE(values_.dim() == 4, "values must be [batch, kv_heads, tokens, head_dim], got ",
                    values_.sizes());
  TORCH_CHECK_VALUE(keys_.size(0) == 1, "keys must hold one conversation (batch 1), got batch ",
                    keys_.size(0));
  // head_dim may differ between keys and values (e.g. MLA); heads and tokens may not.
  TORCH_CHECK_VALUE(keys_.size(0) == values_.size(0) && keys_.size(1) == values_.size(1) &&
                        keys_.size(2) == values_.size(2),
                    "keys ", keys_.sizes(), " and values ", values_.sizes(),
                    " disagree on batch, heads or tokens");
  TORCH_CHECK_VALUE(keys_.scalar_type() == values_.scalar_type(), "keys dtype ",
                    keys_.scalar_type(), " differs from values dtype ", values_.scalar_type());
  TORCH_CHECK_VALUE(keys_.device() == values_.device(), "keys device ", keys_.device(),
                    " differs from values device ", values_.device());
  TORCH_CHECK_VALUE(at::isFloatingType(keys_.scalar_type()),
                    "keys must be a floating-point tensor, got ", keys_.scalar_type());
}

LayerStatePtr AttentionState::cropped(int64_t n) const {
  TORCH_CHECK_INDEX(can_crop_to(n), "cannot crop an attention layer of ", num_tokens(),
                    " tokens to ", n);
  if (n == num_tokens()) return std::make_shared<AttentionState>(keys_, values_);
  return std::make_shared<AttentionState>(keys_.narrow(2, 0, n), values_.narrow(2, 0, n));
}

bool AttentionState::finite_from(int64_t begin) const {
  begin = std::max<int64_t>(begin, 0);
  if (begin >= num_tokens()) return true;
  const int64_t len = num_tokens() - begin;
  return keys_.narrow(2, begin, len).isfinite().all().item<bool>() &&
         values_.narrow(2, begin, len).isfinite().all().item<bool>();
}

void check_layers_consistent(const std::vector<LayerStatePtr>& layers, int64_t expected_tokens) {
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK_VALUE(layers[i] != nullptr, "layer ", i, " is missing");
    TORCH_CHECK_VALUE(layers[i]->num_tokens() == expected_tokens, "layer ", i, " holds ",
                      layers[i]->num_tokens(), " tokens but token_ids has ", expected_tokens);
    TORCH_CHECK_VALUE(layers[i]->dtype() == layers[0]->dtype(), "layer ", i, " dtype ",
                      layers[i]->dtype(), " differs from layer 0 dtype ", layers[0]->dtype());
    TORCH_CHECK_VALUE(layers[i]->device() == layers[0]->device(), "layer ", i, " device ",
                      layers[i]->device(), " differs from layer 0 device ", layers[0]->device());
  }
}

}  // namespace kvchat
