// Checkpoints: the state of every layer at one token position, so layers that
// cannot crop (recurrent, conv, slid windows) can be brought back there.
#pragma once

#include <cstdint>
#include <vector>

#include "kvchat/layer_state.h"
#include "kvchat/turn_checks.h"

namespace kvchat {

struct Checkpoint {
  int64_t position = 0;
  // One entry per layer; nullptr where the layer's live state can simply be
  // cropped back to `position` (attention), so nothing is duplicated.
  std::vector<LayerStatePtr> states;
};

// How many checkpoints a session keeps. When over either bound, checkpoints
// are thinned: the highest always stays (a regenerate or a re-tokenized reply
// needs it), and the one closest to the checkpoint below it goes first, since
// losing it costs only that gap in re-prefill. Survivors spread back over the
// conversation, so an edit of an older message still finds one.
struct CheckpointPolicy {
  int64_t max_count = 8;
  int64_t max_bytes = 0;  // 0: no byte bound
};

// Validates a checkpoint against the layer count; names what is wrong.
void check_checkpoint(const Checkpoint& checkpoint, int64_t num_layers, int64_t max_position);

// Whether every layer can be brought back to `position`, by cropping its live
// state or from `checkpoint` (which may be null).
bool restorable(const std::vector<LayerStatePtr>& layers, int64_t position,
                const Checkpoint* checkpoint);

// Merges `added` into `kept` (same position: added wins), sorts by position
// and thins them (see CheckpointPolicy) until `policy` holds. `needed`: where
// the next turn is expected to depart from the cached ids (a reply the chat
// template renders otherwise, say); the highest checkpoint at or below it is
// the one that turn restores, so thinning keeps it first, before even the
// highest of all (-1: nothing is known, the highest comes first).
std::vector<Checkpoint> merge_checkpoints(std::vector<Checkpoint> kept,
                                          std::vector<Checkpoint> added,
                                          const CheckpointPolicy& policy, int64_t needed = -1);

// Where a turn's prefill stops to snapshot its non-croppable layers. Each
// stop is one more forward, and on a hybrid model one forward costs about
// what prefilling tens of tokens does (every weight is read again), so the
// default stops at most once. Two checkpoints cost no forward and a turn with
// such layers always takes them (see TurnPlan): the state it starts from,
// which the session holds anyway, and the state at the prompt's end.
enum class CheckpointPlacement {
  // The final message's start, when it lies kMinCheckpointGap or more tokens
  // past the cache's end: on a first turn, the end of the system prompt. With
  // the two free ones this covers the next turn, a reply that re-tokenizes
  // differently, a template that rewrites the last reply, and an edit of any
  // user message. A regenerate re-prefills the last message.
  kLastMessage,
  // Every message boundary (message ends and the generation prompt's start)
  // and n-1, the last point before the final prompt token, so a regenerate
  // reuses all but that token. Costs a forward per position, every turn.
  kEveryMessage,
};

// A message start closer than this to the cache's end is left to the free
// checkpoint there: a forward costs more than re-prefilling that many tokens.
constexpr int64_t kMinCheckpointGap = 64;

// Where a turn whose prompt is ids[0:n) and whose cache ends at `begin`
// stops its prefill to snapshot, by `placement`: positions in (begin, n-1].
// Either placement also stops at n - rewritten_tail when that is positive: a
// template that renders the generation prompt differently in history (one
// that opens a <think> block there, say) makes the next prompt diverge
// inside it, before the free checkpoint at the prompt's end.
std::vector<int64_t> checkpoint_positions(
    const int64_t* ids, int64_t n, int64_t begin, const TurnMarkers& markers,
    CheckpointPlacement placement = CheckpointPlacement::kEveryMessage, int64_t rewritten_tail = 0);

void collect_checkpoint_storage(const std::vector<Checkpoint>& checkpoints, StorageBytes* seen);
int64_t checkpoint_bytes(const std::vector<Checkpoint>& checkpoints);

}  // namespace kvchat
