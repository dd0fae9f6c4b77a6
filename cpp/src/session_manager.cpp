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
  turn_lock_.unlock();
  session_.reset();
  manager_->release(id);
}

SessionManager::SessionManager(ManagerLimits limits) : limits_(limits) {
  TORCH_CHECK_VALUE(limits_.max_sessions >= 1, "max_sessions must be >= 1, got ",
                    limits_.max_sessions);
  TORCH_CHECK_VALUE(limits_.max_cache_bytes >= 0,
                    "max_cache_bytes must be >= 0 (0 means no limit), got ",
                    limits_.max_cache_bytes);
  TORCH_CHECK_VALUE(limits_.num_layers >= 0, "num_layers must be >= 0, got ", limits_.num_layers);
}

std::unique_ptr<SessionLease> SessionManager::acquire(const std::string& id, bool wait) {
  TORCH_CHECK_VALUE(!id.empty(), "session_id must be a non-empty string");
  std::shared_ptr<ChatSession> session;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& entry = entries_[id];
    if (!entry.session)
      entry.session = std::make_shared<ChatSession>(id, limits_.num_layers, limits_.checkpoints);
    entry.in_use += 1;
    entry.last_used = ++clock_;
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
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = entries_.find(id);
  if (it == entries_.end()) return;
  it->second.in_use -= 1;
  enforce_limits_locked();
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
  std::lock_guard<std::mutex> lock(mutex_);
  auto& entry = entry_or_throw(entries_, id);
  if (entry.in_use > 0) throw SessionBusyError("session_id '" + id + "' is in use; cannot clear");
  entry.session->invalidate_cache();
  entry.session->clear_messages();
}

void SessionManager::remove(const std::string& id) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto& entry = entry_or_throw(entries_, id);
  if (entry.in_use > 0) throw SessionBusyError("session_id '" + id + "' is in use; cannot remove");
  removed_totals_ += entry.session->counters();
  entries_.erase(id);
}

int64_t SessionManager::resident_bytes_locked() const {
  StorageBytes seen;
  for (const auto& [id, entry] : entries_) entry.session->collect_storage(&seen);
  return total_bytes(seen);
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
  out.evictions = evictions_;
  out.resident_bytes = resident_bytes_locked();
  out.sessions = static_cast<int64_t>(entries_.size());
  return out;
}

void SessionManager::enforce_limits() {
  std::lock_guard<std::mutex> lock(mutex_);
  enforce_limits_locked();
}

void SessionManager::enforce_limits_locked() {
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
    victim->second->session->invalidate_cache();
    ++victim;
    ++evictions_;
    --resident;
    return true;
  };
  while (resident > limits_.max_sessions && evict_next()) {
  }
  if (limits_.max_cache_bytes > 0) {
    while (resident_bytes_locked() > limits_.max_cache_bytes && evict_next()) {
    }
  }
}

}  // namespace kvchat
