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
  }
  return "unknown";
}

namespace {

bool all_layers_can_crop_to(const std::vector<LayerStatePtr>& layers, int64_t p) {
  return std::all_of(layers.begin(), layers.end(),
                     [p](const LayerStatePtr& layer) { return layer->can_crop_to(p); });
}

}  // namespace

ReusePlan plan_reuse(const std::vector<int64_t>& cached_ids, const int64_t* prompt,
                     int64_t prompt_tokens, int64_t trusted_tokens,
                     const std::vector<LayerStatePtr>& layers) {
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
  if (!all_layers_can_crop_to(layers, limit)) {
    // Without a checkpoint, a layer that cannot crop to `limit` can only start over.
    why << "a layer cannot be brought back to token " << limit << "; ";
    limit = 0;
    capped = true;
  }
  plan.kept_tokens = limit;

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
