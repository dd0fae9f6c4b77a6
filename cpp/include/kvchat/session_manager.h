// Sessions by id, with LRU eviction by count and by bytes. Thread-safe; a
// session in use (leased) is never evicted.
//
// Lock order. Three kinds of mutex, always taken in this order:
//   1. ChatSession::turn_mutex_, one per session: held by a SessionLease for
//      a whole turn (or settle step), across the model's run in Python. It is
//      waited for only in SessionManager::acquire, holding no other core lock
//      and with the GIL released. While holding its own, a turn may try_lock
//      another session's (share_prefix, to rebase an idle donor), never wait.
//   2. SessionManager::mutex_: the manager's tables; held briefly, and no
//      turn lock is taken under it.
//   3. ChatSession::mutex_, one per session: the session's cache, history and
//      counters; held briefly, taken alone or under the manager's (eviction,
//      stats, clear, remove); never two sessions' at once, and never with
//      the manager's taken after it.
// And the GIL: a thread holding a turn lock runs Python, so it takes the GIL;
// hence nothing waits for a turn lock holding the GIL (the bindings release
// it first). No tensor dies under locks 2 or 3 (a dying tensor with a Python
// object takes the GIL; what a locked section drops dies after it, see
// Graveyard and ChatSession), so their holders never wait for the GIL, and
// the bindings release the GIL before taking them all the same.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "kvchat/chat_session.h"
#include "kvchat/radix_tree.h"
#include "kvchat/shared_prefix.h"
#include "kvchat/turn.h"

namespace kvchat {

// Thrown for a session id the manager does not hold (Python: KeyError).
class UnknownSessionError : public std::out_of_range {
 public:
  using std::out_of_range::out_of_range;
};

// Thrown when a session is in use and the caller asked not to wait.
class SessionBusyError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct ManagerLimits {
  int64_t max_sessions = 16;     // sessions that may hold a cache at once
  int64_t max_cache_bytes = 0;   // resident plus reserved bytes; 0 means no limit
  int64_t num_layers = 0;        // layers every commit must provide (0: any)
  CheckpointPolicy checkpoints;  // per session; checkpoint bytes count toward max_cache_bytes
  // Sessions share prefixes of at least this many tokens, cut at a message
  // boundary (where there is none, at a multiple of this); 0 turns sharing off.
  int64_t min_shared_tokens = 0;
  // Keep what eviction drops in a queue (take_evicted) for spilling to disk.
  bool keep_evicted = false;
  // Sessions named "namespace/name" share prefixes only within their
  // namespace (a server's tenants never reuse each other's caches).
  bool isolate_namespaces = false;
};

// A session's cache as eviction found it, waiting to be spilled.
struct EvictedCache {
  std::string id;
  CachedState state;
};

struct ManagerStats {
  SessionCounters totals;
  int64_t evictions = 0;
  int64_t resident_bytes = 0;
  int64_t checkpoint_bytes = 0;  // the part of resident_bytes held by checkpoints
  int64_t reserved_bytes = 0;    // held outside the sessions (set_reserved_bytes)
  int64_t sessions = 0;
  int64_t resident_sessions = 0;
  int64_t shared_prefixes = 0;  // prefixes held once for several sessions
  int64_t prefix_shares = 0;    // turns that started from another session's prefix
  int64_t shared_tokens = 0;    // tokens those turns did not prefill
  double hit_rate() const;      // reused / (reused + prefilled)
};

class SessionManager;

// Exclusive use of one session for one turn. Releasing it (or destroying it)
// lets the manager evict again.
class SessionLease {
 public:
  SessionLease(std::shared_ptr<SessionManager> manager, std::shared_ptr<ChatSession> session,
               std::unique_lock<std::mutex> turn_lock);
  ~SessionLease();
  SessionLease(const SessionLease&) = delete;
  SessionLease& operator=(const SessionLease&) = delete;

  const std::shared_ptr<ChatSession>& session() const;  // throws once released
  void release();                                       // idempotent
  bool active() const { return session_ != nullptr; }

 private:
  friend class SessionManager;
  std::shared_ptr<SessionManager> manager_;
  std::shared_ptr<ChatSession> session_;
  std::unique_lock<std::mutex> turn_lock_;
};

class SessionManager : public std::enable_shared_from_this<SessionManager> {
 public:
  explicit SessionManager(ManagerLimits limits, TurnSettings settings = {});

  // Gets or creates the session and takes it for one turn. With wait=false a
  // session already in use raises SessionBusyError instead of blocking; with
  // create=false an unknown id raises UnknownSessionError and creates nothing;
  // with touch=false the lease leaves the LRU order alone (background work,
  // such as settling, is no use of the session).
  std::unique_ptr<SessionLease> acquire(const std::string& id, bool wait = true, bool create = true,
                                        bool touch = true);

  std::shared_ptr<ChatSession> find(const std::string& id) const;  // UnknownSessionError
  bool contains(const std::string& id) const;
  std::vector<std::string> session_ids() const;  // least recently used first
  // Drops the session's cache and history (keeps its system prompt).
  void clear(const std::string& id);
  // Forgets the session entirely.
  void remove(const std::string& id);
  ManagerStats stats() const;
  const ManagerLimits& limits() const { return limits_; }
  const TurnSettings& settings() const { return settings_; }
  // Evicts least-recently-used idle sessions until the limits hold.
  void enforce_limits();
  // Bytes held outside the sessions (the engine's decode batch, which copies
  // every decoding row's cache) that count toward max_cache_bytes beside the
  // resident caches. Setting them evicts idle sessions until resident plus
  // reserved fits; what only leased sessions hold stays over the budget.
  void set_reserved_bytes(int64_t bytes);
  int64_t reserved_bytes() const;

  // The caches evicted since the last call (with limits.keep_evicted).
  std::vector<EvictedCache> take_evicted();

  // --- one turn (see turn.h) on the session `lease` holds ---
  // Decides what the turn starts from. With `plain` (a reason), nothing is
  // touched: the turn runs as plain generate. Otherwise: restores `reloaded`
  // (a storage tier's copy of a non-resident session; one that does not fit is
  // refused and named in reload_error), plans, starts from another session's
  // prefix when that keeps more, and hands the layer states at the plan's
  // point to the turn. The Turn returned is finished or aborted (its
  // destructor aborts it); one that throws here leaves nothing to abort.
  // `rewritten_tail`: how many of the prompt's last tokens the chat template
  // renders differently once the reply follows (see checkpoint_positions).
  // `reload_reason`: what a turn that starts from `reloaded` reports, as the
  // tier that gave it says (kTierReload, or kStoreReload for a shared store).
  // Throws c10::Error for a released lease, or another manager's.
  Turn begin_turn(const SessionLease& lease, const int64_t* prompt, int64_t n,
                  int64_t max_new_tokens, std::optional<CachedState> reloaded = std::nullopt,
                  std::optional<ReuseReason> plain = std::nullopt, int64_t rewritten_tail = 0,
                  ReuseReason reload_reason = ReuseReason::kTierReload);

  // --- settling between turns (see turn.h): each under a lease of this
  // manager's (as begin_turn), and the prefill between them without one ---
  // Plans bringing the leased session to target[0:n): where its cache departs
  // from it, the checkpoint or crop to start from, and the checkpoints to take.
  SettlePlan begin_settle(const SessionLease& lease, const int64_t* target, int64_t n) const;
  // Commits the settled cache when the session's cache is still the version
  // the plan was made from; false (nothing changes) when it moved on.
  bool finish_settle(const SessionLease& lease, const SettlePlan& plan, SettleResult result);

  // Cross-session sharing (when limits.min_shared_tokens > 0). Call with the
  // session leased, after planning (`own`: the session's plan for `prompt`):
  // when another resident session or a shared prefix holds more of `prompt`
  // than `own` keeps, the session starts from it (by reference). Returns the
  // tokens it starts with, or 0; when not 0, plan again.
  int64_t share_prefix(ChatSession& session, const int64_t* prompt, int64_t n,
                       const ReusePlan& own);

 private:
  friend class SessionLease;
  friend class Turn;
  // The session `lease` holds; throws unless it is this manager's and still held.
  ChatSession& leased(const SessionLease& lease) const;
  struct Entry {
    std::shared_ptr<ChatSession> session;
    int64_t in_use = 0;
    uint64_t last_used = 0;
  };
  // What a locked section drops; it dies after the lock is released, since a
  // tensor with a Python object needs the GIL to die (see ChatSession).
  struct Graveyard {
    std::vector<CachedState> caches;
    std::vector<SharedPrefixPtr> prefixes;
    std::vector<std::shared_ptr<ChatSession>> sessions;
  };
  void release(const std::string& id);
  // Turn::finish: checks and commits what the model left, sets the messages
  // and records the turn. A commit that throws leaves the session no cache.
  TurnRecord finish_turn(ChatSession& session, const TurnPlan& plan, TurnResult result) const;
  // Before any lease lets go: dedupes the session onto the longest shared
  // prefix of its ids and indexes its ids for others.
  void reindex(ChatSession& session);
  void enforce_limits_locked(Graveyard* dead);
  // What a session id may share with: its namespace ("a/" of "a/b") when
  // limits.isolate_namespaces, else everything ("").
  std::string share_scope(const std::string& id) const;
  void forget_index_locked(const std::string& id);
  // Drops the caches of `id` waiting in evicted_ (see take_evicted).
  void drop_evicted_locked(const std::string& id, Graveyard* dead);
  void drop_unused_prefixes_locked(Graveyard* dead);
  int64_t resident_bytes_locked() const;

  const ManagerLimits limits_;
  const TurnSettings settings_;
  mutable std::mutex mutex_;  // guards entries_, clock_, counters below
  std::unordered_map<std::string, Entry> entries_;
  uint64_t clock_ = 0;
  int64_t evictions_ = 0;
  int64_t reserved_bytes_ = 0;      // see set_reserved_bytes
  SessionCounters removed_totals_;  // counters of sessions already removed
  // Sharing: what resident sessions hold (by session id) and the shared
  // prefixes (by their own keys). Both only narrow the search; every use
  // re-checks the session's ids under its own lock.
  TokenRadixTree session_index_;
  TokenRadixTree prefix_index_;
  std::unordered_map<std::string, SharedPrefixPtr> prefixes_;
  int64_t next_prefix_ = 0;
  int64_t prefix_shares_ = 0;
  int64_t shared_tokens_ = 0;
  std::vector<EvictedCache> evicted_;
};

}  // namespace kvchat
