// A token prefix whose state several sessions share (a common system prompt):
// one compact copy of every layer after `ids`, read by all, written by none.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvchat/layer_state.h"

namespace kvchat {

struct SharedPrefix {
  std::vector<int64_t> ids;
  // One per layer, each after ids.size() tokens, owning compact storage.
  std::vector<LayerStatePtr> states;

  int64_t num_tokens() const { return static_cast<int64_t>(ids.size()); }
  // Whether any session still holds a part of it.
  bool referenced() const;
};

using SharedPrefixPtr = std::shared_ptr<const SharedPrefix>;

}  // namespace kvchat
