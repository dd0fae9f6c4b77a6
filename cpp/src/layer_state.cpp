#include "kvchat/layer_state.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace kvchat {

std::string to_string(LayerKind kind) {
  switch (kind) {
    case LayerKind::kAttention:
      return "attention";
    case LayerKind::kSlidingWindow:
      return "sliding_window";
    case LayerKind::kRecurrent:
      return "recurrent";
    case LayerKind::kHybrid:
      return "hybrid";
  }
  return "unknown";
}

void add_storage(const at::Tensor& tensor, StorageBytes* seen) {
  if (!tensor.defined() || !tensor.has_storage()) return;
  const auto& storage = tensor.storage();
  (*seen)[storage.data()] = static_cast<int64_t>(storage.nbytes());
}

int64_t total_bytes(const StorageBytes& seen) {
  int64_t total = 0;
  for (const auto& [ptr, bytes] : seen) total += bytes;
  return total;
}

bool all_finite(const std::vector<at::Tensor>& tensors) {
  // A sum is finite only if every element is (NaN and Inf propagate), and it
  // reads a strided view in place. An overflowing sum of huge finite values
  // would read as non-finite: that costs a re-prefill, never a wrong answer.
  std::vector<at::Tensor> sums;
  sums.reserve(tensors.size());
  for (const auto& t : tensors) {
    if (t.numel() > 0) sums.push_back(t.sum(at::kFloat));
  }
  if (sums.empty()) return true;
  return at::stack(sums).isfinite().all().item<bool>();
}

void LayerState::collect_storage(StorageBytes* seen) const {
  for (const auto& t : tensors()) add_storage(t, seen);
}

bool LayerState::can_restore(int64_t n, const LayerState* snapshot) const {
  if (can_crop_to(n)) return true;
  return snapshot != nullptr && snapshot->kind() == kind() && snapshot->num_tokens() == n;
}

LayerStatePtr LayerState::restored(int64_t n, const LayerStatePtr& snapshot) const {
  if (can_crop_to(n)) return cropped(n);
  TORCH_CHECK_INDEX(can_restore(n, snapshot.get()), "a ", to_string(kind()), " layer of ",
                    num_tokens(), " tokens cannot return to token ", n, " without a snapshot ",
                    "taken there");
  return snapshot;
}

AttentionState::AttentionState(at::Tensor keys, at::Tensor values)
    : keys_(std::move(keys)), values_(std::move(values)) {
  check_tensors();
}

AttentionState::AttentionState(std::shared_ptr<const AttentionState> prefix, at::Tensor keys,
                               at::Tensor values)
    : prefix_(std::move(prefix)), keys_(std::move(keys)), values_(std::move(values)) {
  TORCH_CHECK_VALUE(prefix_ != nullptr, "prefix must be an attention state");
  TORCH_CHECK_VALUE(prefix_->prefix_ == nullptr, "a shared prefix cannot sit on another prefix");
  check_tensors();
  const auto& pk = prefix_->keys_;
  const auto& pv = prefix_->values_;
  TORCH_CHECK_VALUE(
      pk.size(1) == keys_.size(1) && pk.size(3) == keys_.size(3) && pv.size(3) == values_.size(3),
      "keys ", keys_.sizes(), " do not continue the prefix's keys ", pk.sizes());
  TORCH_CHECK_VALUE(pk.scalar_type() == keys_.scalar_type() && pk.device() == keys_.device(),
                    "keys (", keys_.scalar_type(), ", ", keys_.device(),
                    ") differ from the prefix's (", pk.scalar_type(), ", ", pk.device(), ")");
}

void AttentionState::check_tensors() const {
  TORCH_CHECK_VALUE(keys_.defined() && values_.defined(), "keys and values must be tensors");
  TORCH_CHECK_VALUE(keys_.dim() == 4, "keys must be [batch, kv_heads, tokens, head_dim], got ",
                    keys_.sizes());
  TORCH_CHECK_VALUE(values_.dim() == 4, "values must be [batch, kv_heads, tokens, head_dim], got ",
                    values_.sizes());
  TORCH_CHECK_VALUE(keys_.size(0) == 1, "keys must hold one conversation (batch 1), got batch ",
                    keys_.size(0));
  // head_dim may differ between keys and values (e.g. MLA); heads and tokens may not.
  TORCH_CHECK_VALUE(keys_.size(0) == values_.size(0) && keys_.size(1) == values_.size(1) &&
                        keys_.size(2) == values_.size(2),
                    "keys ", keys_.sizes(), " and values ", values_.sizes(),
                    " disagree on batch, heads or tokens");
  TORCH_CHECK_VALUE(keys_.scalar_type() == values_.scalar_type(), "keys dtype ",
                    keys_.scalar_type(), " differs from values dtype ", values_.scalar_type());
  TORCH_CHECK_VALUE(keys_.device() == values_.device(), "keys device ", keys_.device(),
                    " differs from values device ", values_.device());
  TORCH_CHECK_VALUE(at::isFloatingType(keys_.scalar_type()),
                    "keys must be a floating-point tensor, got ", keys_.scalar_type());
}

std::shared_ptr<AttentionState> AttentionState::from_buffer(const KvBuffer& buffer) {
  auto state = std::make_shared<AttentionState>(buffer.keys(), buffer.values());
  state->key_arena_ = buffer.key_arena();
  state->value_arena_ = buffer.value_arena();
  return state;
}

std::shared_ptr<AttentionState> AttentionState::on_prefix(
    std::shared_ptr<const AttentionState> prefix, const AttentionState& whole) {
  TORCH_CHECK_VALUE(prefix != nullptr, "prefix must be an attention state");
  const int64_t shared = prefix->num_tokens();
  TORCH_CHECK_INDEX(whole.num_tokens() >= shared, "a state of ", whole.num_tokens(),
                    " tokens cannot sit on a prefix of ", shared);
  if (whole.prefix_ == prefix) return std::make_shared<AttentionState>(whole);
  const auto tail = whole.tensors_from(shared);
  at::Tensor keys, values;
  if (tail.empty()) {
    keys = prefix->keys_.narrow(2, 0, 0).clone();
    values = prefix->values_.narrow(2, 0, 0).clone();
  } else {
    // tensors_from gives one (keys, values) pair per segment it spans.
    std::vector<at::Tensor> ks, vs;
    for (size_t i = 0; i < tail.size(); i += 2) {
      ks.push_back(tail[i]);
      vs.push_back(tail[i + 1]);
    }
    keys = at::cat(ks, 2).contiguous();
    values = at::cat(vs, 2).contiguous();
  }
  return std::make_shared<AttentionState>(std::move(prefix), std::move(keys), std::move(values));
}

at::Tensor AttentionState::keys() const {
  return prefix_ ? at::cat({prefix_->keys_, keys_}, 2) : keys_;
}

at::Tensor AttentionState::values() const {
  return prefix_ ? at::cat({prefix_->values_, values_}, 2) : values_;
}

KvBuffer AttentionState::buffer(int64_t capacity) const {
  if (prefix_) {
    // One copy of the prefix and the tail into an arena this turn may extend.
    auto out = KvBuffer::empty_like(keys_, values_, std::max(capacity, num_tokens()));
    out.append(prefix_->keys_, prefix_->values_);
    out.append(keys_, values_);
    return out;
  }
  auto out = key_arena_ && value_arena_ ? KvBuffer(key_arena_, value_arena_, num_tokens())
                                        : KvBuffer(keys_, values_);
  if (capacity > 0) out.reserve(capacity);
  return out;
}

LayerStatePtr AttentionState::cropped(int64_t n) const {
  TORCH_CHECK_INDEX(can_crop_to(n), "cannot crop an attention layer of ", num_tokens(),
                    " tokens to ", n);
  const int64_t shared = prefix_tokens();
  if (prefix_ && n <= shared) return prefix_->cropped(n);
  std::shared_ptr<AttentionState> out;
  if (n == num_tokens()) {
    out = std::make_shared<AttentionState>(*this);
  } else if (prefix_) {
    out = std::make_shared<AttentionState>(prefix_, keys_.narrow(2, 0, n - shared),
                                           values_.narrow(2, 0, n - shared));
  } else {
    out = std::make_shared<AttentionState>(keys_.narrow(2, 0, n), values_.narrow(2, 0, n));
    out->key_arena_ = key_arena_;
    out->value_arena_ = value_arena_;
  }
  return out;
}

std::vector<at::Tensor> AttentionState::tensors_from(int64_t begin) const {
  begin = std::max<int64_t>(begin, 0);
  const int64_t shared = prefix_tokens();
  std::vector<at::Tensor> out;
  if (prefix_ && begin < shared) out = prefix_->tensors_from(begin);
  const int64_t own = keys_.size(2);
  const int64_t from = std::max<int64_t>(begin - shared, 0);
  if (from < own) {
    out.push_back(keys_.narrow(2, from, own - from));
    out.push_back(values_.narrow(2, from, own - from));
  }
  return out;
}

void AttentionState::collect_storage(StorageBytes* seen) const {
  if (prefix_) prefix_->collect_storage(seen);
  add_storage(keys_, seen);
  add_storage(values_, seen);
}

LayerStatePtr AttentionState::without_slack() const {
  if (!key_arena_ || !value_arena_) return nullptr;
  const int64_t own = keys_.size(2);
  if (key_arena_->capacity() <= KvBuffer::grown_capacity(own)) return nullptr;
  // Arena-backed states never sit on a shared prefix (see from_buffer and cropped).
  TORCH_INTERNAL_ASSERT(prefix_ == nullptr);
  return std::make_shared<AttentionState>(keys_.clone(), values_.clone());
}

LayerStatePtr compact_copy(const LayerState& state) {
  if (const auto* attention = dynamic_cast<const AttentionState*>(&state)) {
    // On a shared prefix, keys() already concatenates into a fresh tensor.
    auto own = [&](at::Tensor t) {
      return attention->prefix() ? t : t.clone(at::MemoryFormat::Contiguous);
    };
    return std::make_shared<AttentionState>(own(attention->keys()), own(attention->values()));
  }
  if (const auto* hybrid = dynamic_cast<const HybridState*>(&state)) {
    TORCH_CHECK_VALUE(hybrid->attention() != nullptr,
                      "a hybrid snapshot without its attention part cannot be copied whole");
    return std::make_shared<HybridState>(compact_copy(*hybrid->attention()),
                                         compact_copy(*hybrid->recurrent()));
  }
  // Sliding windows and recurrent states snapshot as compact clones already.
  return state.snapshot();
}

SlidingWindowState::SlidingWindowState(at::Tensor keys, at::Tensor values, int64_t total_tokens)
    : attention_(std::move(keys), std::move(values)), total_tokens_(total_tokens) {
  TORCH_CHECK_VALUE(total_tokens_ >= attention_.num_tokens(), "total_tokens (", total_tokens_,
                    ") must be >= the tokens held in keys (", attention_.num_tokens(), ")");
}

bool SlidingWindowState::can_crop_to(int64_t n) const {
  // Exact only while nothing has slid out of the window.
  const bool nothing_dropped = held_tokens() == total_tokens_;
  return n == total_tokens_ || (nothing_dropped && n >= 0 && n <= total_tokens_);
}

LayerStatePtr SlidingWindowState::cropped(int64_t n) const {
  TORCH_CHECK_INDEX(can_crop_to(n), "cannot crop a sliding-window layer holding ", held_tokens(),
                    " of ", total_tokens_, " tokens to ", n);
  auto view = attention_.cropped(n - (total_tokens_ - held_tokens()));
  auto tensors = view->tensors();
  return std::make_shared<SlidingWindowState>(tensors[0], tensors[1], n);
}

LayerStatePtr SlidingWindowState::snapshot() const {
  // A clone, so the snapshot does not pin the larger buffer the window views.
  return std::make_shared<SlidingWindowState>(
      attention_.keys().clone(at::MemoryFormat::Contiguous),
      attention_.values().clone(at::MemoryFormat::Contiguous), total_tokens_);
}

std::vector<at::Tensor> SlidingWindowState::tensors_from(int64_t begin) const {
  return attention_.tensors_from(begin - (total_tokens_ - held_tokens()));
}

RecurrentState::RecurrentState(std::vector<at::Tensor> tensors, int64_t total_tokens)
    : tensors_(std::move(tensors)), total_tokens_(total_tokens) {
  TORCH_CHECK_VALUE(!tensors_.empty(), "a recurrent state needs at least one tensor");
  TORCH_CHECK_VALUE(total_tokens_ >= 0, "total_tokens must be >= 0, got ", total_tokens_);
  for (size_t i = 0; i < tensors_.size(); ++i) {
    TORCH_CHECK_VALUE(tensors_[i].defined(), "recurrent tensors[", i, "] is undefined");
    TORCH_CHECK_VALUE(tensors_[i].dim() >= 1 && tensors_[i].size(0) == 1, "recurrent tensors[", i,
                      "] must hold one conversation (batch 1), got shape ", tensors_[i].sizes());
    TORCH_CHECK_VALUE(tensors_[i].device() == tensors_[0].device(), "recurrent tensors[", i,
                      "] is on ", tensors_[i].device(), " but tensors[0] is on ",
                      tensors_[0].device());
  }
}

LayerStatePtr RecurrentState::cropped(int64_t n) const {
  TORCH_CHECK_INDEX(can_crop_to(n), "a recurrent layer of ", total_tokens_,
                    " tokens cannot crop to ", n, "; restore a checkpoint instead");
  return std::make_shared<RecurrentState>(tensors_, total_tokens_);
}

LayerStatePtr RecurrentState::snapshot() const {
  std::vector<at::Tensor> copies;
  copies.reserve(tensors_.size());
  for (const auto& t : tensors_) copies.push_back(t.clone(at::MemoryFormat::Contiguous));
  return std::make_shared<RecurrentState>(std::move(copies), total_tokens_);
}

LayerStatePtr RecurrentState::shared_snapshot() const {
  return std::make_shared<RecurrentState>(tensors_, total_tokens_);
}

std::vector<at::Tensor> RecurrentState::tensors_from(int64_t /*begin*/) const {
  // The whole state summarises every token, new ones included.
  return tensors_;
}

HybridState::HybridState(LayerStatePtr attention, LayerStatePtr recurrent)
    : attention_(std::move(attention)), recurrent_(std::move(recurrent)) {
  TORCH_CHECK_VALUE(recurrent_ && recurrent_->kind() == LayerKind::kRecurrent,
                    "a hybrid layer's recurrent part must be a RecurrentState, got ",
                    recurrent_ ? to_string(recurrent_->kind()) : "None");
  if (!attention_) return;
  TORCH_CHECK_VALUE(
      attention_->kind() == LayerKind::kAttention ||
          attention_->kind() == LayerKind::kSlidingWindow,
      "a hybrid layer's attention part must be an attention or sliding-window state, got ",
      to_string(attention_->kind()));
  TORCH_CHECK_VALUE(attention_->num_tokens() == recurrent_->num_tokens(),
                    "a hybrid layer's attention holds ", attention_->num_tokens(),
                    " tokens but its recurrent part ", recurrent_->num_tokens());
}

bool HybridState::can_crop_to(int64_t n) const {
  return attention_ && attention_->can_crop_to(n) && recurrent_->can_crop_to(n);
}

LayerStatePtr HybridState::cropped(int64_t n) const {
  TORCH_CHECK_INDEX(can_crop_to(n), "a hybrid layer of ", num_tokens(), " tokens cannot crop to ",
                    n, "; restore a checkpoint instead");
  return std::make_shared<HybridState>(attention_->cropped(n), recurrent_->cropped(n));
}

LayerStatePtr HybridState::snapshot() const {
  return std::make_shared<HybridState>(attention_ ? attention_->snapshot() : nullptr,
                                       recurrent_->snapshot());
}

LayerStatePtr HybridState::shared_snapshot() const {
  return std::make_shared<HybridState>(attention_ ? attention_->shared_snapshot() : nullptr,
                                       recurrent_->shared_snapshot());
}

bool HybridState::can_restore(int64_t n, const LayerState* snapshot) const {
  if (can_crop_to(n)) return true;
  const auto* hybrid = dynamic_cast<const HybridState*>(snapshot);
  return attention_ && hybrid && hybrid->num_tokens() == n &&
         attention_->can_restore(n, hybrid->attention_.get());
}

LayerStatePtr HybridState::restored(int64_t n, const LayerStatePtr& snapshot) const {
  if (can_crop_to(n)) return cropped(n);
  TORCH_CHECK_INDEX(can_restore(n, snapshot.get()), "a hybrid layer of ", num_tokens(),
                    " tokens cannot return to token ", n, " without a snapshot taken there");
  const auto& hybrid = static_cast<const HybridState&>(*snapshot);
  // The live KV crops (a view); only the recurrent part comes from the snapshot.
  return std::make_shared<HybridState>(attention_->restored(n, hybrid.attention_),
                                       hybrid.recurrent_);
}

std::vector<at::Tensor> HybridState::tensors() const {
  std::vector<at::Tensor> all;
  if (attention_) all = attention_->tensors();
  const auto rest = recurrent_->tensors();
  all.insert(all.end(), rest.begin(), rest.end());
  return all;
}

void HybridState::collect_storage(StorageBytes* seen) const {
  if (attention_) attention_->collect_storage(seen);
  recurrent_->collect_storage(seen);
}

LayerStatePtr HybridState::without_slack() const {
  auto attention = attention_ ? attention_->without_slack() : nullptr;
  return attention ? std::make_shared<HybridState>(std::move(attention), recurrent_) : nullptr;
}

at::ScalarType HybridState::dtype() const {
  return attention_ ? attention_->dtype() : recurrent_->dtype();
}

at::Device HybridState::device() const { return recurrent_->device(); }

std::vector<at::Tensor> HybridState::tensors_from(int64_t begin) const {
  auto all = attention_ ? attention_->tensors_from(begin) : std::vector<at::Tensor>{};
  const auto rest = recurrent_->tensors_from(begin);
  all.insert(all.end(), rest.begin(), rest.end());
  return all;
}

LayerMeta HybridState::meta() const {
  LayerMeta out{kind(), num_tokens(), 0, {}};
  for (const auto& part : parts()) {
    out.parts.push_back(part->meta());
    out.tensors += out.parts.back().tensors;
  }
  return out;
}

std::vector<LayerStatePtr> HybridState::parts() const {
  if (!attention_) return {recurrent_};
  return {attention_, recurrent_};
}

namespace {

// The tensors [begin, begin + count) of `tensors`, named for errors.
std::vector<at::Tensor> take(const std::vector<at::Tensor>& tensors, size_t begin, int64_t count) {
  return {tensors.begin() + static_cast<std::ptrdiff_t>(begin),
          tensors.begin() + static_cast<std::ptrdiff_t>(begin + count)};
}

}  // namespace

LayerStatePtr layer_state_from(const LayerMeta& meta, std::vector<at::Tensor> tensors) {
  const auto given = static_cast<int64_t>(tensors.size());
  TORCH_CHECK_VALUE(meta.tensors == given, "a ", to_string(meta.kind), " state of ", meta.tensors,
                    " tensors was given ", given);
  TORCH_CHECK_VALUE(meta.tokens >= 0, "a ", to_string(meta.kind), " state of ", meta.tokens,
                    " tokens");
  TORCH_CHECK_VALUE(meta.kind == LayerKind::kHybrid || meta.parts.empty(), "a ",
                    to_string(meta.kind), " state has no parts, got ", meta.parts.size());
  switch (meta.kind) {
    case LayerKind::kAttention: {
      TORCH_CHECK_VALUE(given == 2, "an attention state needs keys and values, got ", given,
                        " tensors");
      auto state = std::make_shared<AttentionState>(tensors[0], tensors[1]);
      TORCH_CHECK_VALUE(state->num_tokens() == meta.tokens, "an attention state of ", meta.tokens,
                        " tokens holds ", state->num_tokens());
      return state;
    }
    case LayerKind::kSlidingWindow:
      TORCH_CHECK_VALUE(given == 2, "a sliding-window state needs keys and values, got ", given,
                        " tensors");
      return std::make_shared<SlidingWindowState>(tensors[0], tensors[1], meta.tokens);
    case LayerKind::kRecurrent:
      return std::make_shared<RecurrentState>(std::move(tensors), meta.tokens);
    case LayerKind::kHybrid: {
      const auto n = meta.parts.size();
      TORCH_CHECK_VALUE(n == 1 || n == 2, "a hybrid state has 1 or 2 parts, got ", n);
      std::vector<LayerStatePtr> built;
      size_t next = 0;
      for (const auto& part : meta.parts) {
        TORCH_CHECK_VALUE(part.tensors >= 0 && next + part.tensors <= tensors.size(),
                          "a hybrid state's parts claim more tensors than its ", given);
        TORCH_CHECK_VALUE(part.tokens == meta.tokens, "a hybrid state of ", meta.tokens,
                          " tokens has a part of ", part.tokens);
        built.push_back(layer_state_from(part, take(tensors, next, part.tensors)));
        next += part.tensors;
      }
      auto attention = n == 2 ? built[0] : nullptr;
      return std::make_shared<HybridState>(std::move(attention), built.back());
    }
  }
  TORCH_CHECK_VALUE(false, "unknown layer kind ", static_cast<int>(meta.kind));
}

namespace {

std::shared_ptr<const AttentionState> as_attention(const LayerStatePtr& state) {
  return std::dynamic_pointer_cast<const AttentionState>(state);
}

}  // namespace

LayerStatePtr on_shared_prefix(const LayerStatePtr& layer, const LayerStatePtr& base) {
  if (auto attention = as_attention(layer)) {
    auto shared = as_attention(base);
    if (!shared || attention->prefix() == shared) return nullptr;
    return AttentionState::on_prefix(shared, *attention);
  }
  const auto* hybrid = dynamic_cast<const HybridState*>(layer.get());
  const auto* hybrid_base = dynamic_cast<const HybridState*>(base.get());
  if (!hybrid || !hybrid_base) return nullptr;
  auto attention = as_attention(hybrid->attention());
  auto shared = as_attention(hybrid_base->attention());
  if (!attention || !shared || attention->prefix() == shared) return nullptr;
  return std::make_shared<HybridState>(AttentionState::on_prefix(shared, *attention),
                                       hybrid->recurrent());
}

bool held_elsewhere(const LayerStatePtr& state) {
  if (state.use_count() > 1) return true;
  const auto* hybrid = dynamic_cast<const HybridState*>(state.get());
  return hybrid && hybrid->attention().use_count() > 1;
}

void check_layers_consistent(const std::vector<LayerStatePtr>& layers, int64_t expected_tokens) {
  const LayerState* first_kv = nullptr;
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK_VALUE(layers[i] != nullptr, "layer ", i, " is missing");
    TORCH_CHECK_VALUE(layers[i]->kind() != LayerKind::kHybrid || layers[i]->parts().size() == 2,
                      "layer ", i,
                      " is a hybrid snapshot without its attention part; a session needs the "
                      "live state");
    TORCH_CHECK_VALUE(layers[i]->num_tokens() == expected_tokens, "layer ", i, " holds ",
                      layers[i]->num_tokens(), " tokens but token_ids has ", expected_tokens);
    // Recurrent states may legitimately be kept in a wider dtype than the KV.
    const bool kv = layers[i]->kind() != LayerKind::kRecurrent;
    TORCH_CHECK_VALUE(!kv || !first_kv || layers[i]->dtype() == first_kv->dtype(), "layer ", i,
                      " dtype ", layers[i]->dtype(), " differs from the first KV layer's dtype ",
                      first_kv ? first_kv->dtype() : layers[i]->dtype());
    if (kv && !first_kv) first_kv = layers[i].get();
    TORCH_CHECK_VALUE(layers[i]->device() == layers[0]->device(), "layer ", i, " device ",
                      layers[i]->device(), " differs from layer 0 device ", layers[0]->device());
  }
}

}  // namespace kvchat
