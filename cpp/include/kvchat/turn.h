// One turn, as the core sees it: SessionManager::begin_turn, given the
// session's lease, decides what the turn starts from and returns a Turn that
// holds the plan (and the layer states); the adapter runs the model;
// Turn::finish checks and commits what the model left and records the turn.
// Between the two the session holds no layers, so a turn that fails there is
// aborted (Turn::abort, or the Turn's destructor) and the session keeps its
// history and no cache: never half a turn.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kvchat/chat_session.h"
#include "kvchat/prefix.h"
#include "kvchat/turn_checks.h"

namespace kvchat {

// Given once, when the manager is built.
struct TurnSettings {
  TurnMarkers markers;        // where messages end, for sharing cuts, checkpoints and checks
  RepetitionRule repetition;  // what counts as a degenerate loop at commit
  // Whether turns take checkpoints (a model with layers that cannot crop
  // back: sliding, conv, recurrent), and where the prefill stops for them.
  bool prefill_checkpoints = false;
  CheckpointPlacement placement = CheckpointPlacement::kLastMessage;
};

// What begin_turn decided. The adapter builds its cache from take_layers(),
// prefills to each checkpoint position, and generates.
struct TurnPlan {
  std::vector<int64_t> prompt;
  int64_t kept_tokens = 0;           // reused from the cache; prefill starts here
  int64_t checkpoint_restored = -1;  // position of a restored checkpoint, or -1
  int64_t reserve = 0;               // tokens of room to give full-attention buffers
  ReuseReason reason = ReuseReason::kNoCache;
  bool plain = false;  // plain generate: no cache goes in, none is stored
  std::string detail;  // the planner's sentence
  // Why a storage tier's cache was refused (empty: none was, or none given).
  std::string reload_error;
  // Positions in (kept_tokens, prompt size) where the prefill snapshots.
  std::vector<int64_t> checkpoint_positions;
  // Whether the adapter snapshots at the prompt's end, once generate has
  // prefilled it (before the first token is sampled): a copy, no forward.
  bool snapshot_prompt_end = false;
  // Taken here: the state at kept_tokens, sharing the layers' storage (the
  // adapter copies what the model updates in place). Turn::finish adds them.
  std::vector<Checkpoint> checkpoints;
  std::vector<LayerStatePtr> layers;  // at kept_tokens; empty when nothing is kept

  int64_t prompt_tokens() const { return static_cast<int64_t>(prompt.size()); }
  // Hands the layers over (once), so the plan pins none of their storage.
  std::vector<LayerStatePtr> take_layers();
};

// What the model produced, for Turn::finish.
struct TurnResult {
  std::vector<int64_t> sequence;      // the prompt, then the generated ids
  std::vector<LayerStatePtr> layers;  // the cache after generation (ignored if plain)
  int64_t cached_tokens = 0;          // tokens those layers hold
  std::vector<Checkpoint> checkpoints;
  std::string text;  // what the cached ids render to, for text matching; empty: unknown
  // The conversation after the turn (the reply included); none: leave it.
  std::optional<std::vector<Message>> messages;
  double prefill_ms = 0.0;
  double total_ms = 0.0;
  // Where the next prompt is predicted to depart from the sequence (-1:
  // unknown): thinning keeps the checkpoint settling or that turn restores.
  int64_t needed_checkpoint = -1;
};

class SessionManager;

// One turn in progress (from SessionManager::begin_turn): move-only, and
// aborted when destroyed unless it was finished or aborted. Use it while the
// lease it was begun under is held. Not thread-safe beyond finish and abort
// racing each other (one wins; the other throws or does nothing).
class Turn {
 public:
  Turn(Turn&& other) noexcept;
  Turn& operator=(Turn&& other) noexcept;  // aborts this turn first if open
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;
  ~Turn();  // abort(), unless finished or aborted; never throws

  // What begin_turn decided; take_layers() hands its layers to the adapter.
  const TurnPlan& plan() const { return plan_; }
  TurnPlan& plan() { return plan_; }
  // Neither finished nor aborted (nor moved from).
  bool open() const { return state_.load() == State::kOpen; }

  // Checks and commits what the model left (a cache whose token count does
  // not match the sequence is dropped, not stored), sets the messages, and
  // records the turn. A finish that throws leaves the turn aborted (a commit
  // that failed leaves the session with no cache). Throws c10::Error on a
  // turn already finished, aborted or moved from.
  TurnRecord finish(TurnResult result);
  // A turn that failed after begin_turn: the session drops its cache (it
  // handed its layers to the turn) and keeps its history; a plain turn
  // changes nothing. Only the cache this turn left is dropped: once anything
  // else changed the session (after the lease was let go, say), nothing is.
  // Does nothing on a turn already finished, aborted or moved from.
  void abort() noexcept;

  enum class State : uint8_t { kOpen, kFinished, kAborted, kMovedFrom };

 private:
  friend class SessionManager;
  Turn(std::shared_ptr<SessionManager> manager, std::shared_ptr<ChatSession> session);
  // Open -> `to`, atomically; false (nothing changes) when it was not open.
  bool close(State to);
  void abort_session() const noexcept;

  std::shared_ptr<SessionManager> manager_;
  std::shared_ptr<ChatSession> session_;
  TurnPlan plan_;
  // The session's cache version once it handed its layers over (0, which no
  // cache has, until then): what abort drops.
  uint64_t taken_version_ = 0;
  std::atomic<State> state_{State::kOpen};
};

// Settling, between two turns: the session is brought to `target`, the ids
// its next prompt is predicted to start with (the history and the reply as
// the client will send them back, rendered by the chat template), so that
// turn prefills only what is new. begin_settle plans it with the session
// leased but takes nothing from it: the session keeps its cache, and any turn
// may run on it, until finish_settle commits the settled cache, which it does
// only if the cache is still the one the plan was made from.
struct SettlePlan {
  std::vector<int64_t> target;
  int64_t kept_tokens = 0;           // reused from the cache; the prefill starts here
  int64_t checkpoint_restored = -1;  // position of a restored checkpoint, or -1
  uint64_t version = 0;              // the session's cache version it was planned from
  // Positions in (kept_tokens, target size) where the prefill snapshots, as a
  // turn with this prompt would.
  std::vector<int64_t> checkpoint_positions;
  std::vector<Checkpoint> checkpoints;  // taken here (the free one at kept_tokens)
  std::vector<LayerStatePtr> layers;    // at kept_tokens (views; the session keeps its own)

  int64_t target_tokens() const { return static_cast<int64_t>(target.size()); }
  // Whether there is anything to prefill (else the session holds the target).
  bool needed() const { return kept_tokens < target_tokens(); }
  std::vector<LayerStatePtr> take_layers();
};

// What the settling prefill left: the layers after target[0:settled_tokens).
// Fewer than the whole target when a turn took over part way.
struct SettleResult {
  int64_t settled_tokens = 0;
  std::vector<LayerStatePtr> layers;
  std::vector<Checkpoint> checkpoints;
};

}  // namespace kvchat
