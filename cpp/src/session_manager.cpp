#include "kvchat/session_manager.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace kvchat {

namespace {

// Works for const and non-const maps of entries alike.
template <typename Entries>
auto& entry_or_throw(Entries& entries, const std::string& id) {
  auto it = entries.find(id);
  if (it == entries.end()) {
    throw UnknownSessionError("session_id '" + id + "' is not a known session");
  }
  return it->second;
}

}  // namespace

double ManagerStats::hit_rate() const {
  const int64_t seen = totals.reused_tokens + totals.prefilled_tokens;
  return seen == 0 ? 0.0 : static_cast<double>(totals.reused_tokens) / static_cast<double>(seen);
}

SessionLease::SessionLease(std::shared_ptr<SessionManager> manager,
                           std::shared_ptr<ChatSession> session,
                           std::unique_lock<std::mutex> turn_lock)
    : manager_(std::move(manager)),
      session_(std::move(session)),
      turn_lock_(std::move(turn_lock)) {}

SessionLease::~SessionLease() { release(); }

const std::shared_ptr<ChatSession>& SessionLease::session() const {
  TORCH_CHECK(session_ != nullptr, "the session lease was already released");
  return session_;
}

void SessionLease::release() {
  if (!session_) return;
  const std::string id = session_->id();
  // Reindexed while the turn lock is held, so no other call sees it half done.
  try {
    manager_->reindex(*session_);
  } catch (const std::exception&) {
    // Reindexing only dedupes storage; a session that keeps its own copy is
    // still correct, and a release must not throw.
  }
  turn_lock_.unlock();
  session_.reset();
  manager_->release(id);
}

SessionManager::SessionManager(ManagerLimits limits, TurnSettings settings)
    : limits_(limits), settings_(std::move(settings)) {
  check_markers(settings_.markers);
  TORCH_CHECK_VALUE(limits_.max_sessions >= 1, "max_sessions must be >= 1, got ",
                    limits_.max_sessions);
  TORCH_CHECK_VALUE(limits_.max_cache_bytes >= 0,
                    "max_cache_bytes must be >= 0 (0 means no limit), got ",
                    limits_.max_cache_bytes);
  TORCH_CHECK_VALUE(limits_.num_layers >= 0, "num_layers must be >= 0, got ", limits_.num_layers);
  TORCH_CHECK_VALUE(limits_.min_shared_tokens >= 0,
                    "min_shared_tokens must be >= 0 (0: no sharing), got ",
                    limits_.min_shared_tokens);
  TORCH_CHECK_VALUE(limits_.checkpoints.max_count >= 0, "max_checkpoints must be >= 0, got ",
                    limits_.checkpoints.max_count);
  TORCH_CHECK_VALUE(limits_.checkpoints.max_bytes >= 0,
                    "max_checkpoint_bytes must be >= 0 (0 means no limit), got ",
                    limits_.checkpoints.max_bytes);
}

std::unique_ptr<SessionLease> SessionManager::acquire(const std::string& id, bool wait, bool create,
                                                      bool touch) {
  TORCH_CHECK_VALUE(!id.empty(), "session_id must be a non-empty string");
  std::shared_ptr<ChatSession> session;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    // Looked up and leased under one lock: a session removed a moment ago is
    // never brought back empty by a caller that only meant to read it.
    if (!create && entries_.find(id) == entries_.end()) {
      throw UnknownSessionError("unknown session_id '" + id + "'");
    }
    auto& entry = entries_[id];
    if (!entry.session)
      entry.session = std::make_shared<ChatSession>(id, limits_.num_layers, limits_.checkpoints);
    entry.in_use += 1;
    if (touch) entry.last_used = ++clock_;
    session = entry.session;
  }
  // The turn lock is taken outside the manager lock, so a long turn on one
  // session never blocks calls on the others.
  std::unique_lock<std::mutex> turn_lock(session->turn_mutex(), std::defer_lock);
  if (wait) {
    turn_lock.lock();
  } else if (!turn_lock.try_lock()) {
    release(id);
    throw SessionBusyError("session_id '" + id + "' is in use by another call");
  }
  return std::make_unique<SessionLease>(shared_from_this(), std::move(session),
                                        std::move(turn_lock));
}

void SessionManager::release(const std::string& id) {
  Graveyard dead;
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  it->second.in_use -= 1;
  enforce_limits_locked(&dead);
}

std::shared_ptr<ChatSession> SessionManager::find(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entry_or_throw(entries_, id).session;
}

bool SessionManager::contains(const std::string& id) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return entries_.count(id) > 0;
}

std::vector<std::string> SessionManager::session_ids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<uint64_t, std::string>> order;
  for (const auto& [id, entry] : entries_) order.emplace_back(entry.last_used, id);
  std::sort(order.begin(), order.end());
  std::vector<std::string> ids;
  for (auto& [used, id] : order) ids.push_back(std::move(id));
  return ids;
}

void SessionManager::clear(const std::string& id) {
  Graveyard dead;
  std::lock_guard<std::mutex> lock(mutex_);
  auto& entry = entry_or_throw(entries_, id);
  if (entry.in_use > 0) throw SessionBusyError("session_id '" + id + "' is in use; cannot clear");
  dead.caches.push_back(entry.session->take_cache());
  entry.session->clear_messages();
  forget_index_locked(id);
  drop_evicted_locked(id, &dead);
}

void SessionManager::remove(const std::string& id) {
  Graveyard dead;
  std::lock_guard<std::mutex> lock(mutex_);
  auto& entry = entry_or_throw(entries_, id);
  if (entry.in_use > 0) throw SessionBusyError("session_id '" + id + "' is in use; cannot remove");
  removed_totals_ += entry.session->counters();
  dead.caches.push_back(entry.session->take_cache());
  dead.sessions.push_back(std::move(entry.session));
  entries_.erase(id);
  forget_index_locked(id);
  drop_evicted_locked(id, &dead);
  drop_unused_prefixes_locked(&dead);
}

void SessionManager::drop_evicted_locked(const std::string& id, Graveyard* dead) {
  // A cache evicted while a turn ran (the decode batch's reservation) waits
  // here for the spill; once its session is cleared or removed it must not
  // reach the tier, where it would outlive the removal.
  auto kept = evicted_.begin();
  for (auto& evicted : evicted_) {
    if (evicted.id == id) {
      dead->caches.push_back(std::move(evicted.state));
    } else {
      *kept++ = std::move(evicted);
    }
  }
  evicted_.erase(kept, evicted_.end());
}

int64_t SessionManager::resident_bytes_locked() const {
  StorageBytes seen;
  for (const auto& [id, entry] : entries_) entry.session->collect_storage(&seen);
  for (const auto& [key, prefix] : prefixes_) {
    for (const auto& state : prefix->states) state->collect_storage(&seen);
  }
  return total_bytes(seen);
}

std::vector<EvictedCache> SessionManager::take_evicted() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<EvictedCache> out;
  out.swap(evicted_);
  return out;
}

void SessionManager::forget_index_locked(const std::string& id) { session_index_.erase(id); }

void SessionManager::drop_unused_prefixes_locked(Graveyard* dead) {
  if (prefixes_.empty()) return;
  StorageBytes by_sessions;
  bool in_flight = false;
  for (const auto& [id, entry] : entries_) {
    entry.session->collect_storage(&by_sessions);
    in_flight = in_flight || entry.in_use > 0;
  }
  for (auto it = prefixes_.begin(); it != prefixes_.end();) {
    if (it->second->referenced(by_sessions, in_flight)) {
      ++it;
    } else {
      prefix_index_.erase(it->first);
      dead->prefixes.push_back(std::move(it->second));
      it = prefixes_.erase(it);
    }
  }
}

std::string SessionManager::share_scope(const std::string& id) const {
  if (!limits_.isolate_namespaces) return {};
  const auto slash = id.find('/');
  return slash == std::string::npos ? id + "/" : id.substr(0, slash + 1);
}

namespace {

bool starts_with(const std::string& text, const std::string& prefix) {
  return text.compare(0, prefix.size(), prefix) == 0;
}

}  // namespace

int64_t SessionManager::share_prefix(ChatSession& session, const int64_t* prompt, int64_t n,
                                     const ReusePlan& own_plan) {
  const int64_t min_tokens = limits_.min_shared_tokens;
  TORCH_CHECK_VALUE(n > 0, "prompt_ids must not be empty");
  TORCH_CHECK_VALUE(own_plan.prompt_tokens == n, "plan is for a prompt of ", own_plan.prompt_tokens,
                    " tokens, not this one of ", n);
  if (min_tokens <= 0 || n <= min_tokens) return 0;
  const int64_t own = own_plan.kept_tokens;
  const int64_t limit = n - 1;  // the last prompt token always runs
  SharedPrefixPtr best;
  std::shared_ptr<ChatSession> donor;
  int64_t donor_common = 0;
  int64_t have = own;  // the most any source gives so far
  // Prefixes are keyed "<scope>prefix:<n>", so a scope sees only its own.
  const std::string scope = share_scope(session.id());
  const std::string prefix_scope = scope + "prefix:";
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto stored = prefix_index_.longest_stored_prefix(
        prompt, limit, [&](const std::string& key) { return starts_with(key, prefix_scope); });
    if (!stored.key.empty()) best = prefixes_.at(stored.key);
    if (best) have = std::max(have, best->num_tokens());
    const auto common = session_index_.longest_common_prefix(
        prompt, limit,
        [&](const std::string& key) { return key != session.id() && starts_with(key, scope); });
    auto found = entries_.find(common.key);
    if (common.length > have && found != entries_.end()) {
      donor = found->second.session;
      donor_common = common.length;
    }
  }
  if (donor) {
    // Cut at a message boundary, so sessions that differ after the system
    // prompt all land on the same prefix instead of one each. A text with no
    // boundary in reach (a text completion, a few-shot header) is cut at a
    // multiple of the minimum instead: prompts that differ a little after a
    // common header still land on one or two prefixes, not one each.
    int64_t cut = last_turn_boundary(prompt, n, donor_common, settings_.markers);
    if (cut < min_tokens) cut = donor_common - donor_common % min_tokens;
    SharedPrefixPtr made =
        cut >= min_tokens && cut > have ? donor->export_prefix(prompt, cut) : nullptr;
    if (made) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        const std::string key = prefix_scope + std::to_string(next_prefix_++);
        prefixes_[key] = made;
        prefix_index_.insert(key, made->ids);
      }
      // The donor drops its own copy now when idle, else when its turn ends.
      std::unique_lock<std::mutex> donor_turn(donor->turn_mutex(), std::try_to_lock);
      if (donor_turn.owns_lock()) donor->rebase_on(*made);
      best = made;
    }
  }
  if (!best || best->num_tokens() < min_tokens || best->num_tokens() <= own) return 0;
  session.adopt_prefix(best);
  std::lock_guard<std::mutex> lock(mutex_);
  prefix_shares_ += 1;
  shared_tokens_ += best->num_tokens();
  return best->num_tokens();
}

void SessionManager::reindex(ChatSession& session) {
  if (limits_.min_shared_tokens <= 0) return;
  const auto ids = session.cached_ids();
  const std::string prefix_scope = share_scope(session.id()) + "prefix:";
  SharedPrefixPtr prefix;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto stored = prefix_index_.longest_stored_prefix(
        ids.data(), ids.size(),
        [&](const std::string& key) { return starts_with(key, prefix_scope); });
    if (!stored.key.empty()) prefix = prefixes_.at(stored.key);
  }
  if (prefix) session.rebase_on(*prefix);
  std::lock_guard<std::mutex> lock(mutex_);
  if (ids.empty() || !entries_.count(session.id())) {
    session_index_.erase(session.id());
  } else {
    session_index_.insert(session.id(), ids);
  }
}

ManagerStats SessionManager::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  ManagerStats out;
  out.totals = removed_totals_;
  for (const auto& [id, entry] : entries_) {
    out.totals += entry.session->counters();
    out.checkpoint_bytes += entry.session->checkpoint_bytes();
    if (entry.session->resident()) out.resident_sessions += 1;
  }
  out.shared_prefixes = static_cast<int64_t>(prefixes_.size());
  out.prefix_shares = prefix_shares_;
  out.shared_tokens = shared_tokens_;
  out.evictions = evictions_;
  out.resident_bytes = resident_bytes_locked();
  out.reserved_bytes = reserved_bytes_;
  out.sessions = static_cast<int64_t>(entries_.size());
  return out;
}

void SessionManager::enforce_limits() {
  Graveyard dead;
  std::lock_guard<std::mutex> lock(mutex_);
  enforce_limits_locked(&dead);
}

void SessionManager::set_reserved_bytes(int64_t bytes) {
  TORCH_CHECK_VALUE(bytes >= 0, "reserved_bytes must be >= 0, got ", bytes);
  Graveyard dead;
  std::lock_guard<std::mutex> lock(mutex_);
  reserved_bytes_ = bytes;
  enforce_limits_locked(&dead);
}

int64_t SessionManager::reserved_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return reserved_bytes_;
}

void SessionManager::enforce_limits_locked(Graveyard* dead) {
  drop_unused_prefixes_locked(dead);
  // Idle resident sessions, least recently used first.
  std::vector<std::pair<uint64_t, Entry*>> idle;
  int64_t resident = 0;
  for (auto& [id, entry] : entries_) {
    if (!entry.session->resident()) continue;
    resident += 1;
    if (entry.in_use == 0) idle.emplace_back(entry.last_used, &entry);
  }
  std::sort(idle.begin(), idle.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  auto victim = idle.begin();
  auto evict_next = [&]() {
    if (victim == idle.end()) return false;  // only sessions in use remain
    auto& session = *victim->second->session;
    if (limits_.keep_evicted) {
      evicted_.push_back({session.id(), session.take_cache()});
    } else {
      dead->caches.push_back(session.take_cache());
    }
    forget_index_locked(session.id());
    drop_unused_prefixes_locked(dead);
    ++victim;
    ++evictions_;
    --resident;
    return true;
  };
  while (resident > limits_.max_sessions && evict_next()) {
  }
  if (limits_.max_cache_bytes > 0) {
    while (resident_bytes_locked() + reserved_bytes_ > limits_.max_cache_bytes && evict_next()) {
    }
  }
}

}  // namespace kvchat
