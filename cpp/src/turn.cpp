// The order of one turn, in one place (see turn.h for the contract).
#include "kvchat/turn.h"

#include <c10/util/Exception.h>

#include <algorithm>

#include "kvchat/kv_buffer.h"
#include "kvchat/session_manager.h"

namespace kvchat {

std::vector<LayerStatePtr> TurnPlan::take_layers() {
  std::vector<LayerStatePtr> out;
  out.swap(layers);
  return out;
}

TurnPlan SessionManager::begin_turn(ChatSession& session, const int64_t* prompt, int64_t n,
                                    int64_t max_new_tokens, std::optional<CachedState> reloaded,
                                    std::optional<ReuseReason> plain, int64_t rewritten_tail) {
  TORCH_CHECK_VALUE(n > 0, "prompt_ids must not be empty");
  TORCH_CHECK_VALUE(rewritten_tail >= 0, "rewritten_tail must be >= 0, got ", rewritten_tail);
  TORCH_CHECK_VALUE(max_new_tokens > 0, "max_new_tokens must be a positive int, got ",
                    max_new_tokens);
  TurnPlan turn;
  turn.prompt.assign(prompt, prompt + n);
  if (plain) {
    turn.plain = true;
    turn.reason = *plain;
    return turn;
  }
  bool reloaded_ok = false;
  if (reloaded) {
    try {  // checked whole by the session; a cache that does not fit is a miss
      session.restore(std::move(*reloaded));
      reloaded_ok = true;
    } catch (const c10::Error& error) {
      turn.reload_error = error.what_without_backtrace();
    }
    reloaded.reset();
  }
  ReusePlan plan = session.plan(prompt, n);
  // Another session's prefix, when it covers more than this plan keeps.
  const int64_t shared = share_prefix(session, prompt, n, plan);
  if (shared > 0) plan = session.plan(prompt, n);
  turn.kept_tokens = plan.kept_tokens;
  turn.checkpoint_restored = plan.checkpoint_position;
  turn.detail = plan.detail;
  turn.reason = plan.reason;
  if (shared > 0 && plan.kept_tokens == shared) {
    turn.reason = ReuseReason::kSharedPrefix;
  } else if (reloaded_ok && plan.kept_tokens > 0) {
    turn.reason = ReuseReason::kTierReload;
  }
  turn.layers = session.layers_for(plan);
  // The turn owns them now, so a buffer that moves to a larger arena frees
  // the old one at once instead of holding both (the turn's peak memory).
  session.release_layers();
  if (settings_.prefill_checkpoints) {
    turn.checkpoint_positions = checkpoint_positions(prompt, n, plan.kept_tokens, settings_.markers,
                                                     settings_.placement, rewritten_tail);
    if (settings_.placement == CheckpointPlacement::kLastMessage) {
      turn.snapshot_prompt_end = true;
      // Where this turn starts is a checkpoint for free: the layers are at
      // kept_tokens now. Skipped when it is one already (a restored checkpoint).
      if (plan.kept_tokens > 0 && plan.checkpoint_position != plan.kept_tokens) {
        Checkpoint start{plan.kept_tokens, {}};
        for (const auto& layer : turn.layers) start.states.push_back(layer->shared_snapshot());
        turn.checkpoints.push_back(std::move(start));
      }
    }
  }
  // Room for the prompt and some of the reply; decoding grows it in amortized
  // steps, so a large max_new_tokens reserves nothing up front.
  turn.reserve = std::min(n + max_new_tokens, KvBuffer::grown_capacity(n));
  return turn;
}

TurnRecord SessionManager::finish_turn(ChatSession& session, const TurnPlan& plan,
                                       TurnResult result) {
  const int64_t n = plan.prompt_tokens();
  const auto total = static_cast<int64_t>(result.sequence.size());
  TORCH_CHECK_VALUE(
      total >= n && std::equal(plan.prompt.begin(), plan.prompt.end(), result.sequence.begin()),
      "the turn's sequence must start with its prompt of ", n, " tokens");
  TurnRecord record;
  record.prompt_tokens = n;
  record.reused_tokens = plan.plain ? 0 : plan.kept_tokens;
  record.prefilled_tokens = n - record.reused_tokens;
  record.output_ids.assign(result.sequence.begin() + n, result.sequence.end());
  record.generated_tokens = total - n;
  record.checkpoint_restored = plan.plain ? -1 : plan.checkpoint_restored;
  record.reason = plan.reason;
  record.prefill_ms = result.prefill_ms;
  record.total_ms = result.total_ms;
  if (!plan.plain) {
    // The cache holds every token but the last sampled one; a cache whose ids
    // cannot be named exactly is never stored.
    if (result.cached_tokens == total - 1 && result.cached_tokens > 0) {
      try {
        auto checkpoints = plan.checkpoints;
        for (auto& cp : result.checkpoints) checkpoints.push_back(std::move(cp));
        session.commit(result.sequence.data(), result.cached_tokens, std::move(result.layers),
                       plan.kept_tokens, settings_.markers, settings_.repetition,
                       std::move(checkpoints), std::move(result.text));
        record.cache_stored = true;
      } catch (...) {
        session.invalidate_cache();
        throw;
      }
    } else {
      session.invalidate_cache();
    }
  }
  if (result.messages) session.set_messages(*result.messages);
  session.record_turn(record);
  return record;
}

void SessionManager::abort_turn(ChatSession& session, const TurnPlan& plan) {
  // A plain turn never took the session's layers; anything else did.
  if (!plan.plain) session.invalidate_cache();
}

}  // namespace kvchat
