// Token-prefix matching and the reuse plan: how much of a cached conversation a
// new prompt may keep, and why.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvchat/checkpoint.h"
#include "kvchat/layer_state.h"

namespace kvchat {

// Length of the longest common prefix of a[0:na) and b[0:nb).
int64_t common_prefix_length(const int64_t* a, int64_t na, const int64_t* b, int64_t nb);

// Every reason a turn reports, one enum: the planner chooses the first five;
// the rest say where the kept tokens came from, or why a turn ran as plain
// generate. to_string gives the name users see (TurnReport.reason).
enum class ReuseReason {
  kNoCache,                // nothing cached: prefill everything
  kExtend,                 // the cache is a strict prefix of the prompt: keep all of it
  kPromptCached,           // the whole prompt is cached (a regenerate): keep all but its last
  kDiverged,               // the prompt departs from the cache: keep up to the divergence
  kInvalidated,            // a check (corruption, repetition, layer limits) capped the reuse
  kSharedPrefix,           // started from a prefix another session holds
  kTierReload,             // started from the cache a storage tier gave back ("spill_reload")
  kUnsupportedLayers,      // cache layers kvchat cannot carry: plain generate
  kMultipleSequences,      // beam search or several sequences: plain generate
  kUnsupportedGeneration,  // a generation mode a cache cannot serve exactly: plain generate
  kStoreReload,            // started from a snapshot in a store other processes share
};

std::string to_string(ReuseReason reason);

struct ReusePlan {
  int64_t cached_tokens = 0;         // tokens the session held
  int64_t prompt_tokens = 0;         // tokens of the new prompt
  int64_t common_prefix = 0;         // LCP of cached ids and prompt
  int64_t kept_tokens = 0;           // tokens reused; always < prompt_tokens
  int64_t checkpoint_position = -1;  // checkpoint restored at kept_tokens, or -1
  ReuseReason reason = ReuseReason::kNoCache;
  std::string detail;  // one human-readable sentence
  int64_t new_tokens() const { return prompt_tokens - kept_tokens; }
};

// Chooses the largest reuse point p that is:
//  - at most the LCP and at most prompt_tokens - 1 (the model must always run
//    the last prompt token, or generation would sample from stale logits);
//  - at most `trusted_tokens` (where checks stopped trusting the cache);
//  - a point every layer can be brought back to, by cropping or from one of
//    `checkpoints` (sorted by position).
ReusePlan plan_reuse(const std::vector<int64_t>& cached_ids, const int64_t* prompt,
                     int64_t prompt_tokens, int64_t trusted_tokens,
                     const std::vector<LayerStatePtr>& layers,
                     const std::vector<Checkpoint>& checkpoints = {});

}  // namespace kvchat
