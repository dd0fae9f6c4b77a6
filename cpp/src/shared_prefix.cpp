#include "kvchat/shared_prefix.h"

namespace kvchat {

bool SharedPrefix::referenced() const {
  for (const auto& state : states) {
    if (state.use_count() > 1) return true;
    // A session rebased on a hybrid layer holds only its attention part.
    const auto* hybrid = dynamic_cast<const HybridState*>(state.get());
    if (hybrid && hybrid->attention().use_count() > 1) return true;
  }
  return false;
}

}  // namespace kvchat
