#include "kvchat/prefix.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <sstream>

namespace kvchat {

int64_t common_prefix_length(const int64_t* a, int64_t na, const int64_t* b, int64_t nb) {
  const int64_t n = std::min(na, nb);
  // std::mismatch compiles to a tight loop; 32k ids compare in microseconds.
  return std::mismatch(a, a + n, b).first - a;
}

std::string to_string(ReuseReason reason) {
  switch (reason) {
    case ReuseReason::kNoCache:
      return "no_cache";
    case ReuseReason::kExtend:
      return "extend";
    case ReuseReason::kPromptCached:
      return "prompt_cached";
    case ReuseReason::kDiverged:
      return "diverged";
    case ReuseReason::kInvalidated:
      return "invalidated";
    case ReuseReason::kSharedPrefix:
      return "shared_prefix";
    case ReuseReason::kTierReload:
      return "spill_reload";
    case ReuseReason::kStoreReload:
      return "store_reload";
    case ReuseReason::kUnsupportedLayers:
      return "unsupported_layers";
    case ReuseReason::kMultipleSequences:
      return "multiple_sequences";
    case ReuseReason::kUnsupportedGeneration:
      return "unsupported_generation";
  }
  return "unknown";
}

namespace {

// The largest position <= limit every layer can return to: by cropping, or
// from a checkpoint. 0 (start over) always works. Returns the checkpoint used.
std::pair<int64_t, const Checkpoint*> best_restore_point(const std::vector<LayerStatePtr>& layers,
                                                         const std::vector<Checkpoint>& checkpoints,
                                                         int64_t limit) {
  if (restorable(layers, limit, nullptr)) return {limit, nullptr};
  for (auto it = checkpoints.rbegin(); it != checkpoints.rend(); ++it) {
    if (it->position <= limit && restorable(layers, it->position, &*it)) {
      return {it->position, &*it};
    }
  }
  return {0, nullptr};
}

}  // namespace

ReusePlan plan_reuse(const std::vector<int64_t>& cached_ids, const int64_t* prompt,
                     int64_t prompt_tokens, int64_t trusted_tokens,
                     const std::vector<LayerStatePtr>& layers,
                     const std::vector<Checkpoint>& checkpoints) {
  TORCH_CHECK_VALUE(prompt_tokens > 0, "prompt_ids must not be empty");
  ReusePlan plan;
  plan.cached_tokens = static_cast<int64_t>(cached_ids.size());
  plan.prompt_tokens = prompt_tokens;
  if (cached_ids.empty() || layers.empty()) {
    plan.reason = ReuseReason::kNoCache;
    plan.detail = "nothing cached";
    return plan;
  }
  plan.common_prefix =
      common_prefix_length(cached_ids.data(), plan.cached_tokens, prompt, prompt_tokens);

  const int64_t token_limit = std::min(plan.common_prefix, prompt_tokens - 1);
  int64_t limit = std::min(token_limit, std::max<int64_t>(trusted_tokens, 0));
  std::ostringstream why;
  bool capped = limit < token_limit;
  if (capped) why << "checks trust only the first " << trusted_tokens << " cached tokens; ";
  const auto [point, checkpoint] = best_restore_point(layers, checkpoints, limit);
  if (checkpoint != nullptr) {
    plan.checkpoint_position = point;
    why << "restored the checkpoint at token " << point << "; ";
  } else if (point < limit) {
    why << "no layer state or checkpoint reaches token " << limit << "; ";
  }
  // Falling back to a checkpoint at a message boundary is the normal hybrid
  // path, not a failed check; only a fall to nothing counts as invalidation.
  capped = capped || (point == 0 && limit > 0);
  plan.kept_tokens = point;

  if (capped) {
    plan.reason = ReuseReason::kInvalidated;
  } else if (plan.common_prefix == plan.cached_tokens && plan.cached_tokens < prompt_tokens) {
    plan.reason = ReuseReason::kExtend;
  } else if (plan.common_prefix == prompt_tokens) {
    plan.reason = ReuseReason::kPromptCached;
  } else {
    plan.reason = ReuseReason::kDiverged;
  }
  why << "kept " << plan.kept_tokens << " of " << plan.cached_tokens << " cached tokens (LCP "
      << plan.common_prefix << ", prompt " << prompt_tokens << ")";
  plan.detail = why.str();
  return plan;
}

}  // namespace kvchat
