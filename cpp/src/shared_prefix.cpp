#include "kvchat/shared_prefix.h"

namespace kvchat {

bool SharedPrefix::referenced(const StorageBytes& by_sessions, bool in_flight) const {
  for (const auto& state : states) {
    if (in_flight && held_elsewhere(state)) return true;
    StorageBytes own;
    state->collect_storage(&own);
    for (const auto& [data, bytes] : own) {
      // Empty storage (zero-width values) has no address to share.
      if (bytes > 0 && by_sessions.count(data) > 0) return true;
    }
  }
  return false;
}

}  // namespace kvchat
