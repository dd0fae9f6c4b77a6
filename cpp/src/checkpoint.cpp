#include "kvchat/checkpoint.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <map>

namespace kvchat {

void check_checkpoint(const Checkpoint& checkpoint, int64_t num_layers, int64_t max_position) {
  TORCH_CHECK_INDEX(checkpoint.position > 0 && checkpoint.position <= max_position,
                    "checkpoint position must be in [1, ", max_position, "], got ",
                    checkpoint.position);
  TORCH_CHECK_VALUE(static_cast<int64_t>(checkpoint.states.size()) == num_layers, "checkpoint at ",
                    checkpoint.position, " has ", checkpoint.states.size(), " states for ",
                    num_layers, " layers");
  for (size_t i = 0; i < checkpoint.states.size(); ++i) {
    const auto& state = checkpoint.states[i];
    TORCH_CHECK_VALUE(!state || state->num_tokens() == checkpoint.position, "checkpoint at ",
                      checkpoint.position, ": layer ", i, " state holds ",
                      state ? state->num_tokens() : 0, " tokens");
  }
}

bool restorable(const std::vector<LayerStatePtr>& layers, int64_t position,
                const Checkpoint* checkpoint) {
  const bool usable = checkpoint != nullptr && checkpoint->position == position;
  for (size_t i = 0; i < layers.size(); ++i) {
    const bool has_state = usable && i < checkpoint->states.size();
    if (!layers[i]->can_restore(position, has_state ? checkpoint->states[i].get() : nullptr)) {
      return false;
    }
  }
  return true;
}

void collect_checkpoint_storage(const std::vector<Checkpoint>& checkpoints, StorageBytes* seen) {
  for (const auto& cp : checkpoints) {
    for (const auto& state : cp.states) {
      if (state) state->collect_storage(seen);
    }
  }
}

int64_t checkpoint_bytes(const std::vector<Checkpoint>& checkpoints) {
  StorageBytes seen;
  collect_checkpoint_storage(checkpoints, &seen);
  return total_bytes(seen);
}

std::vector<Checkpoint> merge_checkpoints(std::vector<Checkpoint> kept,
                                          std::vector<Checkpoint> added,
                                          const CheckpointPolicy& policy) {
  std::map<int64_t, Checkpoint> by_position;
  for (auto& cp : kept) by_position[cp.position] = std::move(cp);
  for (auto& cp : added) by_position[cp.position] = std::move(cp);
  std::vector<Checkpoint> merged;
  for (auto& [position, cp] : by_position) merged.push_back(std::move(cp));
  auto over = [&]() {
    const auto count = static_cast<int64_t>(merged.size());
    return count > policy.max_count ||
           (policy.max_bytes > 0 && count > 0 && checkpoint_bytes(merged) > policy.max_bytes);
  };
  // Sorted by position, so the front is the lowest.
  while (!merged.empty() && over()) merged.erase(merged.begin());
  return merged;
}

}  // namespace kvchat
