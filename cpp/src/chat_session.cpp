#include "kvchat/chat_session.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <sstream>

namespace kvchat {

namespace {

// One sequence for every session: a version names one cache, whichever
// session (or a session of the same id made anew) holds it.
uint64_t next_version() {
  static std::atomic<uint64_t> counter{0};
  return ++counter;
}

}  // namespace

void SessionCounters::add(const TurnRecord& turn) {
  requests += 1;
  reused_tokens += turn.reused_tokens;
  prefilled_tokens += turn.prefilled_tokens;
  generated_tokens += turn.generated_tokens;
  if (turn.reason == ReuseReason::kInvalidated) invalidations += 1;
  if (turn.checkpoint_restored >= 0) checkpoint_restores += 1;
}

SessionCounters& SessionCounters::operator+=(const SessionCounters& other) {
  requests += other.requests;
  reused_tokens += other.reused_tokens;
  prefilled_tokens += other.prefilled_tokens;
  generated_tokens += other.generated_tokens;
  invalidations += other.invalidations;
  checkpoint_restores += other.checkpoint_restores;
  checkpoints_taken += other.checkpoints_taken;
  settles += other.settles;
  settled_tokens += other.settled_tokens;
  return *this;
}

ChatSession::ChatSession(std::string id, int64_t num_layers, CheckpointPolicy policy)
    : id_(std::move(id)), num_layers_(num_layers), policy_(policy), version_(next_version()) {
  TORCH_CHECK_VALUE(!id_.empty(), "session_id must be a non-empty string");
  TORCH_CHECK_VALUE(num_layers_ >= 0, "num_layers must be >= 0, got ", num_layers_);
  TORCH_CHECK_VALUE(policy_.max_count >= 0, "max_checkpoints must be >= 0, got ",
                    policy_.max_count);
  TORCH_CHECK_VALUE(policy_.max_bytes >= 0, "max_checkpoint_bytes must be >= 0, got ",
                    policy_.max_bytes);
}

void ChatSession::add_message(const std::string& role, const std::string& content) {
  TORCH_CHECK_VALUE(!role.empty(), "message role must be a non-empty string");
  std::lock_guard<std::mutex> lock(mutex_);
  if (role == "system") {
    system_prompt_ = content;
  } else {
    messages_.push_back({role, content, {}});
  }
}

void ChatSession::set_messages(const std::vector<Message>& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    TORCH_CHECK_VALUE(!messages[i].role.empty(), "messages[", i, "] has an empty role");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  system_prompt_.reset();
  messages_.clear();
  for (size_t i = 0; i < messages.size(); ++i) {
    if (i == 0 && messages[i].role == "system") {
      system_prompt_ = messages[i].content;
    } else {
      messages_.push_back(messages[i]);
    }
  }
}

void ChatSession::clear_messages() {
  std::lock_guard<std::mutex> lock(mutex_);
  messages_.clear();
}

std::vector<Message> ChatSession::messages() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<Message> all;
  if (system_prompt_) all.push_back({"system", *system_prompt_, {}});
  all.insert(all.end(), messages_.begin(), messages_.end());
  return all;
}

std::optional<std::string> ChatSession::system_prompt() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return system_prompt_;
}

ReusePlan ChatSession::plan(const int64_t* prompt, int64_t prompt_tokens) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return plan_reuse(cached_ids_, prompt, prompt_tokens, trusted_tokens_, layers_, checkpoints_);
}

int64_t ChatSession::held_tokens(const int64_t* prompt, int64_t prompt_tokens) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const int64_t common = common_prefix_length(
      cached_ids_.data(), static_cast<int64_t>(cached_ids_.size()), prompt, prompt_tokens);
  return std::min(common, trusted_tokens_);
}

std::vector<LayerStatePtr> ChatSession::layers_for(const ReusePlan& plan) const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (plan.kept_tokens == 0) return {};
  const auto cached = static_cast<int64_t>(cached_ids_.size());
  TORCH_CHECK_INDEX(plan.kept_tokens <= cached && plan.cached_tokens == cached, "plan keeps ",
                    plan.kept_tokens, " of ", plan.cached_tokens,
                    " tokens but the session now holds ", cached, "; plan again");
  const Checkpoint* checkpoint = nullptr;
  for (const auto& cp : checkpoints_) {
    if (cp.position == plan.checkpoint_position) checkpoint = &cp;
  }
  TORCH_CHECK_INDEX(plan.checkpoint_position < 0 || checkpoint != nullptr,
                    "plan restores a checkpoint at ", plan.checkpoint_position,
                    " that the session no longer holds; plan again");
  std::vector<LayerStatePtr> out;
  out.reserve(layers_.size());
  static const LayerStatePtr kNone;
  for (size_t i = 0; i < layers_.size(); ++i) {
    out.push_back(
        layers_[i]->restored(plan.kept_tokens, checkpoint ? checkpoint->states[i] : kNone));
  }
  return out;
}

bool ChatSession::commit(const int64_t* ids, int64_t n, std::vector<LayerStatePtr> layers,
                         int64_t new_from, const TurnMarkers& markers, const RepetitionRule& rule,
                         std::vector<Checkpoint> checkpoints, std::string text, int64_t needed,
                         std::optional<uint64_t> expected_version) {
  TORCH_CHECK_VALUE(n > 0, "token_ids must not be empty");
  TORCH_CHECK_VALUE(num_layers_ == 0 || static_cast<int64_t>(layers.size()) == num_layers_,
                    "layers has ", layers.size(), " entries but the model has ", num_layers_,
                    " layers");
  TORCH_CHECK_VALUE(!layers.empty(), "layers must not be empty");
  TORCH_CHECK_INDEX(new_from >= 0 && new_from <= n, "new_from must be in [0, ", n, "], got ",
                    new_from);
  check_layers_consistent(layers, n);
  for (const auto& cp : checkpoints) check_checkpoint(cp, static_cast<int64_t>(layers.size()), n);
  // Room left over from decoding is given back, so the budget counts what the
  // session needs, not what the turn reserved.
  for (auto& layer : layers) {
    if (auto compact = layer->without_slack()) layer = std::move(compact);
  }

  // Checks inspect only the region that is new this turn.
  int64_t trusted = n;
  std::ostringstream why;
  const int64_t loop_start = find_repetition_loop(ids, new_from, n, rule);
  if (loop_start >= 0) {
    trusted = std::min(trusted, last_turn_boundary(ids, n, loop_start, markers));
    why << "degenerate repetition from token " << loop_start << "; ";
  }
  std::vector<at::Tensor> new_region;
  for (const auto& layer : layers) {
    const auto part = layer->tensors_from(new_from);
    new_region.insert(new_region.end(), part.begin(), part.end());
  }
  if (!all_finite(new_region)) {
    size_t bad = 0;  // rare path: name the first offending layer
    while (bad + 1 < layers.size() && layers[bad]->finite_from(new_from)) ++bad;
    trusted = std::min(trusted, last_turn_boundary(ids, n, new_from, markers));
    why << "non-finite values in layer " << bad << " after token " << new_from << "; ";
  }

  // Checkpoints inside the unchanged prefix still describe the new ids. Merged
  // outside the lock, so thinned ones die there (see the header: no tensor is
  // destroyed under the lock).
  std::vector<Checkpoint> kept;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& cp : checkpoints_) {
      if (cp.position <= new_from) kept.push_back(cp);
    }
  }
  const auto taken = static_cast<int64_t>(checkpoints.size());
  auto merged = merge_checkpoints(std::move(kept), std::move(checkpoints), policy_, needed);
  CachedState old;
  std::lock_guard<std::mutex> lock(mutex_);
  // `merged` and `layers` die after the lock if the cache moved on meanwhile.
  if (expected_version && *expected_version != version_) return false;
  version_ = next_version();
  counters_.checkpoints_taken += taken;
  old.checkpoints.swap(checkpoints_);
  old.layers.swap(layers_);
  checkpoints_ = std::move(merged);
  cached_ids_.assign(ids, ids + n);
  cached_text_ = std::move(text);
  layers_ = std::move(layers);
  trusted_tokens_ = trusted;
  last_check_ = why.str();
  return true;
}

void ChatSession::invalidate_cache() {
  const CachedState dropped = take_cache();  // dies here, after the lock
}

bool ChatSession::invalidate_cache_if(uint64_t version) {
  CachedState dropped;  // dies after the lock
  std::lock_guard<std::mutex> lock(mutex_);
  if (version_ != version) return false;
  take_cache_locked(&dropped);
  return true;
}

CachedState ChatSession::take_cache() {
  CachedState out;
  std::lock_guard<std::mutex> lock(mutex_);
  take_cache_locked(&out);
  return out;
}

void ChatSession::take_cache_locked(CachedState* out) {
  out->ids.swap(cached_ids_);
  out->layers.swap(layers_);
  out->checkpoints.swap(checkpoints_);
  out->text.swap(cached_text_);
  out->trusted_tokens = trusted_tokens_;
  trusted_tokens_ = 0;
  last_check_.clear();
  version_ = next_version();
}

uint64_t ChatSession::release_layers() {
  std::vector<LayerStatePtr> released;
  std::lock_guard<std::mutex> lock(mutex_);
  cached_ids_.clear();
  cached_text_.clear();
  released.swap(layers_);
  version_ = next_version();
  return version_;
}

namespace {

bool starts_with(const std::vector<int64_t>& ids, const int64_t* prefix, int64_t n) {
  return static_cast<int64_t>(ids.size()) >= n && std::equal(prefix, prefix + n, ids.begin());
}

}  // namespace

SharedPrefixPtr ChatSession::export_prefix(const int64_t* ids, int64_t n) const {
  TORCH_CHECK_VALUE(n > 0, "a shared prefix needs at least one token, got ", n);
  std::lock_guard<std::mutex> lock(mutex_);
  if (layers_.empty() || n > trusted_tokens_ || !starts_with(cached_ids_, ids, n)) return nullptr;
  const Checkpoint* checkpoint = nullptr;
  for (const auto& cp : checkpoints_) {
    if (cp.position == n) checkpoint = &cp;
  }
  if (!restorable(layers_, n, checkpoint)) return nullptr;
  auto prefix = std::make_shared<SharedPrefix>();
  prefix->ids.assign(ids, ids + n);
  static const LayerStatePtr kNone;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const auto state = layers_[i]->restored(n, checkpoint ? checkpoint->states[i] : kNone);
    prefix->states.push_back(compact_copy(*state));
  }
  return prefix;
}

void ChatSession::adopt_prefix(const SharedPrefixPtr& prefix) {
  TORCH_CHECK_VALUE(prefix && !prefix->states.empty(), "a shared prefix must hold layer states");
  TORCH_CHECK_VALUE(num_layers_ == 0 || prefix->states.size() == static_cast<size_t>(num_layers_),
                    "shared prefix has ", prefix->states.size(), " layers but the session has ",
                    num_layers_);
  check_layers_consistent(prefix->states, prefix->num_tokens());
  // The prefix doubles as a checkpoint for layers that cannot crop back to it.
  Checkpoint at_prefix{prefix->num_tokens(), {}};
  bool needed = false;
  for (const auto& state : prefix->states) {
    const bool crops = state->kind() == LayerKind::kAttention;
    at_prefix.states.push_back(crops ? nullptr : state);
    needed = needed || !crops;
  }
  CachedState old;
  std::lock_guard<std::mutex> lock(mutex_);
  old.layers.swap(layers_);
  old.checkpoints.swap(checkpoints_);
  cached_ids_ = prefix->ids;
  cached_text_.clear();
  layers_ = prefix->states;
  if (needed) checkpoints_.push_back(std::move(at_prefix));
  trusted_tokens_ = prefix->num_tokens();
  last_check_.clear();
  version_ = next_version();
}

bool ChatSession::rebase_on(const SharedPrefix& prefix) {
  std::vector<LayerStatePtr> old;
  std::lock_guard<std::mutex> lock(mutex_);
  const auto own = static_cast<int64_t>(cached_ids_.size()) - prefix.num_tokens();
  if (layers_.size() != prefix.states.size() || own > prefix.num_tokens() ||
      !starts_with(cached_ids_, prefix.ids.data(), prefix.num_tokens())) {
    return false;
  }
  std::vector<LayerStatePtr> rebased = layers_;
  bool changed = false;
  for (size_t i = 0; i < rebased.size(); ++i) {
    if (auto shared = on_shared_prefix(rebased[i], prefix.states[i])) {
      rebased[i] = std::move(shared);
      changed = true;
    }
  }
  if (changed) {
    old.swap(layers_);
    layers_ = std::move(rebased);
  }
  return changed;
}

CachedState ChatSession::cached_state() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {cached_ids_, layers_, checkpoints_, cached_text_, trusted_tokens_};
}

void ChatSession::restore(CachedState state) {
  const auto n = static_cast<int64_t>(state.ids.size());
  TORCH_CHECK_VALUE(n > 0, "a restored cache needs token ids");
  TORCH_CHECK_VALUE(num_layers_ == 0 || static_cast<int64_t>(state.layers.size()) == num_layers_,
                    "layers has ", state.layers.size(), " entries but the model has ", num_layers_,
                    " layers");
  check_layers_consistent(state.layers, n);
  for (const auto& cp : state.checkpoints) {
    check_checkpoint(cp, static_cast<int64_t>(state.layers.size()), n);
  }
  TORCH_CHECK_INDEX(state.trusted_tokens >= 0 && state.trusted_tokens <= n,
                    "trusted_tokens must be in [0, ", n, "], got ", state.trusted_tokens);
  std::sort(state.checkpoints.begin(), state.checkpoints.end(),
            [](const Checkpoint& a, const Checkpoint& b) { return a.position < b.position; });
  CachedState old;
  std::lock_guard<std::mutex> lock(mutex_);
  old.layers.swap(layers_);
  old.checkpoints.swap(checkpoints_);
  cached_ids_ = std::move(state.ids);
  layers_ = std::move(state.layers);
  checkpoints_ = std::move(state.checkpoints);
  cached_text_ = std::move(state.text);
  trusted_tokens_ = state.trusted_tokens;
  last_check_.clear();
  version_ = next_version();
}

uint64_t ChatSession::version() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return version_;
}

bool ChatSession::resident() const {
  std::lock_guard<std::mutex> lock(mutex_);
  // Checkpoints count too: whatever the budget counts, eviction must be able to free.
  return !layers_.empty() || !checkpoints_.empty();
}

CacheInfo ChatSession::cache_info() const {
  std::lock_guard<std::mutex> lock(mutex_);
  CacheInfo info;
  info.cached_tokens = static_cast<int64_t>(cached_ids_.size());
  info.trusted_tokens = trusted_tokens_;
  info.num_layers = static_cast<int64_t>(layers_.size());
  StorageBytes seen;
  collect_storage_locked(&seen);
  for (const auto& cp : checkpoints_) info.checkpoint_positions.push_back(cp.position);
  info.nbytes = total_bytes(seen);
  info.checkpoints = static_cast<int64_t>(checkpoints_.size());
  info.checkpoint_bytes = kvchat::checkpoint_bytes(checkpoints_);
  if (!layers_.empty()) {
    info.dtype = c10::toString(layers_.front()->dtype());
    info.device = layers_.front()->device().str();
  }
  info.last_check = last_check_;
  return info;
}

std::vector<int64_t> ChatSession::cached_ids() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_ids_;
}

std::string ChatSession::cached_text() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return cached_text_;
}

int64_t ChatSession::checkpoint_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return kvchat::checkpoint_bytes(checkpoints_);
}

void ChatSession::collect_storage(StorageBytes* seen) const {
  std::lock_guard<std::mutex> lock(mutex_);
  collect_storage_locked(seen);
}

void ChatSession::collect_storage_locked(StorageBytes* seen) const {
  for (const auto& layer : layers_) layer->collect_storage(seen);
  collect_checkpoint_storage(checkpoints_, seen);
}

void ChatSession::record_turn(const TurnRecord& turn) {
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.add(turn);
  last_turn_ = turn;
}

void ChatSession::record_settle(int64_t prefilled_tokens) {
  std::lock_guard<std::mutex> lock(mutex_);
  counters_.settles += 1;
  counters_.settled_tokens += prefilled_tokens;
}

std::optional<TurnRecord> ChatSession::last_turn() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return last_turn_;
}

SessionCounters ChatSession::counters() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return counters_;
}

}  // namespace kvchat
