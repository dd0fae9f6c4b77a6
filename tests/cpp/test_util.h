// Small builders shared by the core tests.
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <numeric>
#include <vector>

#include "kvchat/layer_state.h"

namespace kvchat::testing {

// An attention layer of `tokens` positions whose values encode their position.
inline std::shared_ptr<AttentionState> attention_layer(int64_t tokens, int64_t heads = 2,
                                                       int64_t head_dim = 4) {
  auto keys =
      at::arange(tokens, at::kFloat).view({1, 1, tokens, 1}).expand({1, heads, tokens, head_dim});
  return std::make_shared<AttentionState>(keys.contiguous(), keys.contiguous() + 0.5);
}

inline std::vector<LayerStatePtr> attention_layers(int64_t layers, int64_t tokens) {
  std::vector<LayerStatePtr> out;
  for (int64_t i = 0; i < layers; ++i) out.push_back(attention_layer(tokens));
  return out;
}

inline std::vector<int64_t> iota_ids(int64_t n, int64_t start = 100) {
  std::vector<int64_t> ids(n);
  std::iota(ids.begin(), ids.end(), start);
  return ids;
}

}  // namespace kvchat::testing

namespace kvchat::testing {

// A recurrent layer after `tokens` tokens; its value records the position.
inline std::shared_ptr<RecurrentState> recurrent_layer(int64_t tokens) {
  return std::make_shared<RecurrentState>(
      std::vector<at::Tensor>{at::full({1, 3, 4}, static_cast<double>(tokens))}, tokens);
}

}  // namespace kvchat::testing
