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

std::vector<LayerStatePtr> SettlePlan::take_layers() {
  std::vector<LayerStatePtr> out;
  out.swap(layers);
  return out;
}

Turn::Turn(std::shared_ptr<SessionManager> manager, std::shared_ptr<ChatSession> session)
    : manager_(std::move(manager)), session_(std::move(session)) {}

Turn::Turn(Turn&& other) noexcept
    : manager_(std::move(other.manager_)),
      session_(std::move(other.session_)),
      plan_(std::move(other.plan_)),
      taken_version_(other.taken_version_),
      state_(other.state_.exchange(State::kMovedFrom)) {}

Turn& Turn::operator=(Turn&& other) noexcept {
  if (this != &other) {
    abort();
    manager_ = std::move(other.manager_);
    session_ = std::move(other.session_);
    plan_ = std::move(other.plan_);
    taken_version_ = other.taken_version_;
    state_.store(other.state_.exchange(State::kMovedFrom));
  }
  return *this;
}

Turn::~Turn() { abort(); }

namespace {

const char* closed_as(Turn::State state) {
  switch (state) {
    case Turn::State::kFinished:
      return "finished";
    case Turn::State::kAborted:
      return "aborted";
    default:
      return "moved from";
  }
}

}  // namespace

bool Turn::close(State to) {
  State open = State::kOpen;
  return state_.compare_exchange_strong(open, to);
}

TurnRecord Turn::finish(TurnResult result) {
  TORCH_CHECK(close(State::kFinished), "the turn was already ", closed_as(state_.load()),
              "; a turn is finished once");
  try {
    return manager_->finish_turn(*session_, plan_, std::move(result));
  } catch (...) {
    state_.store(State::kAborted);
    abort_session();
    throw;
  }
}

void Turn::abort() noexcept {
  if (close(State::kAborted)) abort_session();
}

void Turn::abort_session() const noexcept {
  // A plain turn never took the session's layers; anything else did, once
  // taken_version_ is set (a begin_turn that threw before took nothing).
  if (plan_.plain || taken_version_ == 0) return;
  try {
    session_->invalidate_cache_if(taken_version_);
  } catch (...) {
    // Only a failure to lock gets here, and an abort must not throw (it runs
    // in destructors): the session is then left as the turn left it, with no
    // layers, its history, and checkpoints that eviction still counts.
  }
}

Turn SessionManager::begin_turn(const SessionLease& lease, const int64_t* prompt, int64_t n,
                                int64_t max_new_tokens, std::optional<CachedState> reloaded,
                                std::optional<ReuseReason> plain, int64_t rewritten_tail,
                                ReuseReason reload_reason) {
  leased(lease);
  TORCH_CHECK_VALUE(n > 0, "prompt_ids must not be empty");
  TORCH_CHECK_VALUE(rewritten_tail >= 0, "rewritten_tail must be >= 0, got ", rewritten_tail);
  TORCH_CHECK_VALUE(
      reload_reason == ReuseReason::kTierReload || reload_reason == ReuseReason::kStoreReload,
      "reload_reason must be spill_reload or store_reload, got ", to_string(reload_reason));
  TORCH_CHECK_VALUE(max_new_tokens > 0, "max_new_tokens must be a positive int, got ",
                    max_new_tokens);
  // Open from here: should anything below throw once the session has handed
  // its layers over, the Turn's destructor aborts it.
  Turn out(shared_from_this(), lease.session());  // session(): throws once released
  ChatSession& session = *out.session_;
  TurnPlan& turn = out.plan_;
  turn.prompt.assign(prompt, prompt + n);
  if (plain) {
    turn.plain = true;
    turn.reason = *plain;
    return out;
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
    turn.reason = reload_reason;
  }
  turn.layers = session.layers_for(plan);
  // The turn owns them now, so a buffer that moves to a larger arena frees
  // the old one at once instead of holding both (the turn's peak memory).
  out.taken_version_ = session.release_layers();
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
  return out;
}

TurnRecord SessionManager::finish_turn(ChatSession& session, const TurnPlan& plan,
                                       TurnResult result) const {
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
                       std::move(checkpoints), std::move(result.text), result.needed_checkpoint);
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

ChatSession& SessionManager::leased(const SessionLease& lease) const {
  TORCH_CHECK_VALUE(lease.manager_.get() == this,
                    "the lease is another SessionManager's; use that one");
  return *lease.session();  // throws once released
}

SettlePlan SessionManager::begin_settle(const SessionLease& lease, const int64_t* target,
                                        int64_t n) const {
  ChatSession& session = leased(lease);
  TORCH_CHECK_VALUE(n > 0, "the settle target must not be empty");
  SettlePlan settle;
  settle.target.assign(target, target + n);
  settle.version = session.version();  // read first: a later change refuses the commit
  const auto cached = session.cached_ids();
  const int64_t common =
      common_prefix_length(cached.data(), static_cast<int64_t>(cached.size()), target, n);
  if (common >= n && n <= session.cache_info().trusted_tokens) {
    settle.kept_tokens = n;  // held already: nothing to do
    return settle;
  }
  // The planner keeps at most n - 1 (a turn must run its last token), which
  // is no limit here: what is held departs from the target before its end.
  const ReusePlan plan = session.plan(target, n);
  settle.kept_tokens = plan.kept_tokens;
  settle.checkpoint_restored = plan.checkpoint_position;
  settle.layers = session.layers_for(plan);
  if (settings_.prefill_checkpoints) {
    // The checkpoints a turn with this prompt would take, so the settled
    // cache is the one a turn builds from the same tokens.
    settle.checkpoint_positions =
        checkpoint_positions(target, n, plan.kept_tokens, settings_.markers, settings_.placement);
    const bool start_is_new = plan.kept_tokens > 0 && plan.checkpoint_position != plan.kept_tokens;
    if (settings_.placement == CheckpointPlacement::kLastMessage && start_is_new) {
      Checkpoint start{plan.kept_tokens, {}};
      for (const auto& layer : settle.layers) start.states.push_back(layer->shared_snapshot());
      settle.checkpoints.push_back(std::move(start));
    }
  }
  return settle;
}

bool SessionManager::finish_settle(const SessionLease& lease, const SettlePlan& plan,
                                   SettleResult result) {
  ChatSession& session = leased(lease);
  TORCH_CHECK_VALUE(
      result.settled_tokens > plan.kept_tokens && result.settled_tokens <= plan.target_tokens(),
      "settled_tokens must be in (", plan.kept_tokens, ", ", plan.target_tokens(), "], got ",
      result.settled_tokens);
  auto checkpoints = plan.checkpoints;
  for (auto& cp : result.checkpoints) {
    if (cp.position <= result.settled_tokens) checkpoints.push_back(std::move(cp));
  }
  const bool done = session.commit(
      plan.target.data(), result.settled_tokens, std::move(result.layers), plan.kept_tokens,
      settings_.markers, settings_.repetition, std::move(checkpoints), {}, -1, plan.version);
  if (done) session.record_settle(result.settled_tokens - plan.kept_tokens);
  return done;
}

}  // namespace kvchat
