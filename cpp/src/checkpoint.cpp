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

namespace {

// The start of the prompt's final message: the second-to-last position in
// (begin, n-1] that follows an end-of-turn id (the last one ends that message).
// -1 when the tail holds no such start.
int64_t final_message_start(const int64_t* ids, int64_t n, int64_t begin,
                            const TurnMarkers& markers) {
  int64_t last = -1;
  int64_t before_last = -1;
  for (int64_t p = begin + 1; p <= n - 1; ++p) {
    const int64_t prev = ids[p - 1];
    const auto& eot = markers.end_of_turn_ids;
    if (std::find(eot.begin(), eot.end(), prev) != eot.end()) {
      before_last = last;
      last = p;
    }
  }
  return before_last;
}

}  // namespace

std::vector<int64_t> checkpoint_positions(const int64_t* ids, int64_t n, int64_t begin,
                                          const TurnMarkers& markers, CheckpointPlacement placement,
                                          int64_t rewritten_tail) {
  TORCH_CHECK_VALUE(n > 0, "prompt_ids must not be empty");
  TORCH_CHECK_INDEX(begin >= 0 && begin < n, "begin must be in [0, ", n - 1, "], got ", begin);
  TORCH_CHECK_VALUE(rewritten_tail >= 0, "rewritten_tail must be >= 0, got ", rewritten_tail);
  std::vector<int64_t> positions;
  if (begin + 1 > n - 1) return positions;
  if (placement == CheckpointPlacement::kLastMessage) {
    const int64_t start = final_message_start(ids, n, begin, markers);
    if (start >= 0 && start - begin >= kMinCheckpointGap) positions.push_back(start);
  } else {
    for (int64_t p : find_turn_boundaries(ids, n, begin + 1, n - 1, markers)) {
      positions.push_back(p);
    }
    if (positions.empty() || positions.back() != n - 1) positions.push_back(n - 1);
  }
  const int64_t rewritten = n - rewritten_tail;
  if (rewritten_tail > 0 && rewritten > begin && rewritten < n) {
    positions.insert(std::upper_bound(positions.begin(), positions.end(), rewritten), rewritten);
    positions.erase(std::unique(positions.begin(), positions.end()), positions.end());
  }
  return positions;
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
                                          const CheckpointPolicy& policy, int64_t needed) {
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
  while (!merged.empty() && over()) {
    if (merged.size() == 1) {
      merged.clear();  // even one is over the byte bound
      break;
    }
    // The one the next turn needs: the highest at or below `needed`; without
    // a hint, the highest (a regenerate or the next turn restores it).
    const size_t highest = merged.size() - 1;
    size_t wanted = highest;
    if (needed >= 0) {
      while (wanted > 0 && merged[wanted].position > needed) --wanted;
      if (merged[wanted].position > needed) wanted = highest;  // none at or below it
    }
    // Without checkpoint i, a restore falls back to the one below it, so its
    // loss costs the gap below it in re-prefilled tokens. Drop the cheapest
    // (ties: the lower); never the wanted one, nor the highest while a third remains.
    auto cost = [&](size_t i) {
      return merged[i].position - (i == 0 ? 0 : merged[i - 1].position);
    };
    size_t drop = merged.size();
    for (size_t i = 0; i < merged.size(); ++i) {
      if (i == wanted || i == highest) continue;
      if (drop == merged.size() || cost(i) < cost(drop)) drop = i;
    }
    if (drop == merged.size()) drop = highest;  // two left: the wanted one stays
    merged.erase(merged.begin() + static_cast<std::ptrdiff_t>(drop));
  }
  return merged;
}

}  // namespace kvchat
