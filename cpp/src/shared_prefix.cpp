#include "kvchat/shared_prefix.h"

namespace kvchat {

bool SharedPrefix::referenced() const {
  for (const auto& state : states) {
    if (held_elsewhere(state)) return true;
  }
  return false;
}

}  // namespace kvchat
