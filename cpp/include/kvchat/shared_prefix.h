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
  // Whether a session still holds a part of it: some of its storage is in
  // `by_sessions` (what every session holds). While turns are in flight
  // (`in_flight`) any other holder counts too, since a turn's plan holds its
  // layers outside the session. A state held only by someone else (a caller's
  // cached_state(), a queued tier write) keeps the memory alive, but not the
  // prefix registered: the manager no longer keeps it.
  bool referenced(const StorageBytes& by_sessions, bool in_flight) const;
};

using SharedPrefixPtr = std::shared_ptr<const SharedPrefix>;

}  // namespace kvchat
