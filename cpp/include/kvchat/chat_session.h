// One conversation: its cached token ids, one state per model layer, its
// message history and its counters.
#pragma once

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "kvchat/checkpoint.h"
#include "kvchat/layer_state.h"
#include "kvchat/prefix.h"
#include "kvchat/shared_prefix.h"
#include "kvchat/turn_checks.h"

namespace kvchat {

struct Message {
  std::string role;
  std::string content;
  // Anything else the message carries (tool calls, a tool call id, a name),
  // as JSON the adapter writes and reads back; empty when there is nothing.
  std::string extras;
};

// What one turn did; the Python adapter fills the timings.
struct TurnRecord {
  int64_t prompt_tokens = 0;
  int64_t reused_tokens = 0;
  int64_t prefilled_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t checkpoint_restored = -1;  // token position of a restored checkpoint, or -1
  double prefill_ms = 0.0;           // time to first token
  double total_ms = 0.0;
  ReuseReason reason = ReuseReason::kNoCache;
  bool cache_stored = false;  // whether the session kept the cache this turn left
  std::vector<int64_t> output_ids;
};

struct SessionCounters {
  int64_t requests = 0;
  int64_t reused_tokens = 0;
  int64_t prefilled_tokens = 0;
  int64_t generated_tokens = 0;
  int64_t invalidations = 0;  // turns whose reuse a check capped
  int64_t checkpoint_restores = 0;
  int64_t checkpoints_taken = 0;
  int64_t settles = 0;         // settled caches committed between turns
  int64_t settled_tokens = 0;  // tokens those settles prefilled
  void add(const TurnRecord& turn);
  SessionCounters& operator+=(const SessionCounters& other);
};

struct CacheInfo {
  int64_t cached_tokens = 0;
  int64_t trusted_tokens = 0;  // reuse is capped here by checks
  int64_t num_layers = 0;
  int64_t nbytes = 0;
  std::string dtype;       // empty when nothing is cached
  std::string device;      // empty when nothing is cached
  std::string last_check;  // why trust was capped, empty when clean
  int64_t checkpoints = 0;
  int64_t checkpoint_bytes = 0;
  std::vector<int64_t> checkpoint_positions;
};

// Everything a session caches, by reference: what a session file holds.
struct CachedState {
  std::vector<int64_t> ids;
  std::vector<LayerStatePtr> layers;
  std::vector<Checkpoint> checkpoints;
  std::string text;
  int64_t trusted_tokens = 0;
};

// Thread-safe. No tensor is destroyed while the session's lock is held: old
// states move to locals that die after it, because a tensor with a Python
// object needs the GIL to die, and a thread holding the GIL may be waiting
// for this lock.
class ChatSession {
 public:
  // num_layers: what every commit must provide (0 accepts any count).
  ChatSession(std::string id, int64_t num_layers, CheckpointPolicy policy = {});

  const std::string& id() const { return id_; }

  // --- message history (the system prompt is kept apart) ---
  // A "system" message replaces the system prompt; others are appended.
  void add_message(const std::string& role, const std::string& content);
  // Replaces the whole history (the system prompt too, when messages has one).
  void set_messages(const std::vector<Message>& messages);
  // Drops the history but keeps the system prompt.
  void clear_messages();
  std::vector<Message> messages() const;
  std::optional<std::string> system_prompt() const;

  // --- cache ---
  ReusePlan plan(const int64_t* prompt, int64_t prompt_tokens) const;
  // How many of the prompt's first tokens this session holds: where its
  // cached ids depart from the prompt, capped where its checks trust them
  // (what a shared tier's snapshot must beat to be worth loading).
  int64_t held_tokens(const int64_t* prompt, int64_t prompt_tokens) const;
  // The layer states at plan.kept_tokens: attention cropped (views, no
  // copies), everything else from the plan's checkpoint.
  std::vector<LayerStatePtr> layers_for(const ReusePlan& plan) const;
  // Stores the cache after a turn. ids[0:n) are the tokens the layers hold;
  // tokens from `new_from` on are new this turn and are the only ones checked.
  // Checkpoints at or before new_from stay valid and are kept; `checkpoints`
  // adds new ones; `needed` is where the next turn is expected to depart from
  // ids, so thinning keeps the checkpoint below it (see merge_checkpoints).
  // `text` is what the ids render to, for text-prefix matching (empty:
  // unknown). Validates everything before changing anything. With
  // `expected_version`, commits only if the cache is still that version
  // (nothing changed it since it was read) and returns whether it did.
  bool commit(const int64_t* ids, int64_t n, std::vector<LayerStatePtr> layers, int64_t new_from,
              const TurnMarkers& markers, const RepetitionRule& rule,
              std::vector<Checkpoint> checkpoints = {}, std::string text = {}, int64_t needed = -1,
              std::optional<uint64_t> expected_version = std::nullopt);
  // Drops the tensors and cached ids; keeps messages and counters.
  void invalidate_cache();
  // Like invalidate_cache, but hands the cache to the caller (to spill it, or
  // to let it die outside a lock the caller holds).
  CachedState take_cache();
  // Hands the layers to the turn in progress (after layers_for): drops the
  // session's references to its ids and tensors, so storage the turn moves
  // is freed at once, not held twice. Checkpoints stay for the commit. A turn
  // that fails after this must invalidate the cache. Returns the version it
  // leaves, for invalidate_cache_if.
  uint64_t release_layers();
  // invalidate_cache, but only while the cache is still `version` (nothing
  // has changed it since); whether it dropped anything. An aborted turn drops
  // what it left, never the cache of whatever changed the session after it.
  bool invalidate_cache_if(uint64_t version);
  // Whether the session holds any tensors (layers or checkpoints).
  bool resident() const;
  // Changes whenever the cache does (a commit, restore, take, release or
  // adopted prefix), and is never the same for two sessions: work planned
  // from one cache (settling, see turn.h) is committed only onto that cache.
  uint64_t version() const;
  // The cache as it stands (empty ids and layers when nothing is cached).
  CachedState cached_state() const;
  // Replaces the cache with `state` (a saved or spilled one) after checking
  // it whole against this session's layer count; on error nothing changes.
  void restore(CachedState state);

  // --- cross-session sharing ---
  // The state after ids[0:n), copied compactly, for other sessions to share;
  // null when this session does not hold those ids or cannot return to n.
  SharedPrefixPtr export_prefix(const int64_t* ids, int64_t n) const;
  // Replaces the cache with `prefix` (by reference): a session starting a
  // conversation another has begun skips prefilling what they share.
  void adopt_prefix(const SharedPrefixPtr& prefix);
  // Re-expresses attention layers on `prefix` when the cached ids start with
  // its ids, so this session stops holding its own copy. That copies the
  // session's own tokens, so it is done only while they are no more than the
  // prefix: the copy never exceeds the memory it frees. True if it did.
  bool rebase_on(const SharedPrefix& prefix);
  CacheInfo cache_info() const;
  std::vector<int64_t> cached_ids() const;
  // The text committed with the cached ids; empty when unknown.
  std::string cached_text() const;
  int64_t checkpoint_bytes() const;
  void collect_storage(StorageBytes* seen) const;

  // --- counters ---
  void record_turn(const TurnRecord& turn);
  void record_settle(int64_t prefilled_tokens);
  std::optional<TurnRecord> last_turn() const;
  SessionCounters counters() const;

 private:
  // The manager leases sessions (SessionManager::acquire) and, sharing a
  // prefix, rebases an idle donor; nothing else may take the turn lock (see
  // the lock order in session_manager.h).
  friend class SessionManager;
  // Held for a whole turn so that two calls on one session run one at a time.
  std::mutex& turn_mutex() { return turn_mutex_; }
  void collect_storage_locked(StorageBytes* seen) const;
  void take_cache_locked(CachedState* out);

  const std::string id_;
  const int64_t num_layers_;
  const CheckpointPolicy policy_;
  mutable std::mutex mutex_;  // guards everything below but turn_mutex_
  std::mutex turn_mutex_;     // held by a SessionLease (session_manager.h)
  std::optional<std::string> system_prompt_;
  std::vector<Message> messages_;
  std::vector<int64_t> cached_ids_;
  std::string cached_text_;
  std::vector<LayerStatePtr> layers_;
  std::vector<Checkpoint> checkpoints_;  // sorted by position
  int64_t trusted_tokens_ = 0;
  uint64_t version_;
  std::string last_check_;
  SessionCounters counters_;
  std::optional<TurnRecord> last_turn_;
};

}  // namespace kvchat
