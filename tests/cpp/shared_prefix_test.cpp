// Cross-session sharing: segmented attention states, a session's export,
// adoption and rebase, and the manager choosing what to share.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "kvchat/session_manager.h"
#include "test_util.h"

namespace kvchat {
namespace {

using testing::attention_layer;
using testing::attention_layers;
using testing::iota_ids;

// Token 2 ends a message, so position 6 below is a message boundary.
const TurnMarkers kMarkers{{2}, {}};
const std::vector<int64_t> kSystem{10, 11, 12, 13, 14, 2};

std::vector<int64_t> conversation(int64_t user_token, int64_t length) {
  auto ids = kSystem;
  while (static_cast<int64_t>(ids.size()) < length) ids.push_back(user_token);
  return ids;
}

std::shared_ptr<const AttentionState> plain(int64_t tokens) { return attention_layer(tokens); }

TEST(SharedAttention, OnPrefixKeepsOnlyTheTail) {
  auto whole = attention_layer(10);
  auto prefix = std::const_pointer_cast<const AttentionState>(
      std::static_pointer_cast<AttentionState>(compact_copy(*whole->cropped(6))));
  auto shared = AttentionState::on_prefix(prefix, *whole);
  EXPECT_EQ(shared->num_tokens(), 10);
  EXPECT_EQ(shared->prefix_tokens(), 6);
  EXPECT_TRUE(at::equal(shared->keys(), whole->keys()));
  EXPECT_TRUE(at::equal(shared->values(), whole->values()));
  // Storage: the prefix once plus a 4-token tail.
  StorageBytes seen;
  shared->collect_storage(&seen);
  AttentionState::on_prefix(prefix, *whole)->collect_storage(&seen);
  EXPECT_EQ(total_bytes(seen), 2 * (6 + 4 + 4) * 2 * 4 * static_cast<int64_t>(sizeof(float)));
}

TEST(SharedAttention, CropsAndReadsAcrossTheSeam) {
  auto whole = attention_layer(10);
  auto shared = AttentionState::on_prefix(plain(6), *whole);
  auto below = std::static_pointer_cast<AttentionState>(shared->cropped(4));
  EXPECT_EQ(below->prefix_tokens(), 0);  // a plain view of the prefix
  EXPECT_TRUE(at::equal(below->keys(), whole->keys().narrow(2, 0, 4)));
  auto above = std::static_pointer_cast<AttentionState>(shared->cropped(8));
  EXPECT_EQ(above->prefix_tokens(), 6);
  EXPECT_TRUE(at::equal(above->keys(), whole->keys().narrow(2, 0, 8)));
  auto parts = shared->tensors_from(4);  // 2 prefix tokens + 4 tail tokens
  ASSERT_EQ(parts.size(), 4u);
  EXPECT_EQ(parts[0].size(2) + parts[2].size(2), 6);
  auto buffer = shared->buffer(16);
  EXPECT_EQ(buffer.capacity(), 16);
  EXPECT_TRUE(at::equal(buffer.keys(), whole->keys()));
}

TEST(SharedAttention, HybridLayersCountSharedStorageWithoutCopying) {
  auto prefix = plain(6);
  auto recurrent = testing::recurrent_layer(10);
  const int64_t per_token = 2 * 2 * 4 * static_cast<int64_t>(sizeof(float));
  const int64_t recurrent_bytes = 3 * 4 * static_cast<int64_t>(sizeof(float));
  StorageBytes seen;
  for (int i = 0; i < 3; ++i) {  // three sessions on one prefix
    HybridState(AttentionState::on_prefix(prefix, *attention_layer(10)), recurrent)
        .collect_storage(&seen);
  }
  // Exact and repeatable: counting must never concatenate into temporaries.
  EXPECT_EQ(total_bytes(seen), (6 + 3 * 4) * per_token + recurrent_bytes);
}

TEST(SharedAttention, RejectsMismatchedTail) {
  auto prefix = plain(6);
  EXPECT_THROW(AttentionState(prefix, at::zeros({1, 3, 2, 4}), at::zeros({1, 3, 2, 4})),
               c10::ValueError);
  EXPECT_THROW(AttentionState::on_prefix(prefix, *attention_layer(3)), c10::IndexError);
}

std::shared_ptr<SessionManager> sharing_manager(int64_t max_bytes = 0, bool isolate = false) {
  ManagerLimits limits{16, max_bytes, 2};
  limits.min_shared_tokens = 4;
  limits.isolate_namespaces = isolate;
  return std::make_shared<SessionManager>(limits, TurnSettings{kMarkers});
}

// share_prefix with the session's own plan for `prompt`, as a turn calls it.
int64_t share(SessionManager& mgr, SessionLease& lease, const std::vector<int64_t>& prompt) {
  auto& session = *lease.session();
  const auto n = static_cast<int64_t>(prompt.size());
  return mgr.share_prefix(session, prompt.data(), n, session.plan(prompt.data(), n));
}

void commit(SessionManager& mgr, const std::string& id, const std::vector<int64_t>& ids) {
  auto lease = mgr.acquire(id);
  const auto n = static_cast<int64_t>(ids.size());
  lease->session()->commit(ids.data(), n, attention_layers(2, n), 0, kMarkers, RepetitionRule{});
}

TEST(SharedPrefixManager, NewSessionStartsFromAnothersSystemPrompt) {
  auto mgr = sharing_manager();
  commit(*mgr, "a", conversation(50, 12));
  const auto prompt = conversation(60, 9);
  auto lease = mgr->acquire("b");
  const int64_t adopted = share(*mgr, *lease, prompt);
  EXPECT_EQ(adopted, 6);  // the system prompt, up to its message boundary
  EXPECT_EQ(lease->session()->cached_ids(), kSystem);
  EXPECT_EQ(lease->session()->plan(prompt.data(), prompt.size()).kept_tokens, 6);
  // The idle donor already dropped its own copy of the prefix.
  auto donor_layer = std::static_pointer_cast<AttentionState>(
      mgr->find("a")->layers_for(mgr->find("a")->plan(conversation(50, 12).data(), 12))[0]);
  EXPECT_EQ(donor_layer->prefix_tokens(), 6);
  const auto stats = mgr->stats();
  EXPECT_EQ(stats.shared_prefixes, 1);
  EXPECT_EQ(stats.prefix_shares, 1);
  EXPECT_EQ(stats.shared_tokens, 6);
}

TEST(SharedPrefixManager, IsolatedNamespacesShareOnlyWithinThemselves) {
  auto mgr = sharing_manager(0, /*isolate=*/true);
  commit(*mgr, "tenant-a/x", conversation(50, 12));
  const auto prompt = conversation(60, 9);
  {
    auto other = mgr->acquire("tenant-b/y");
    EXPECT_EQ(share(*mgr, *other, prompt), 0);  // another tenant's cache: never
  }
  auto same = mgr->acquire("tenant-a/z");
  EXPECT_EQ(share(*mgr, *same, prompt), 6);
  same->release();
  // The prefix made for tenant a is not offered to tenant b either.
  auto other = mgr->acquire("tenant-b/w");
  EXPECT_EQ(share(*mgr, *other, prompt), 0);
  EXPECT_EQ(mgr->stats().prefix_shares, 1);
}

TEST(SharedPrefixManager, SharedStorageIsCountedOnceAndCopyOnWrite) {
  auto mgr = sharing_manager();
  const int64_t per_token = 2 * 2 * 2 * 4 * static_cast<int64_t>(sizeof(float));  // 2 layers
  commit(*mgr, "a", conversation(50, 12));
  const auto a_keys = mgr->find("a")->export_prefix(conversation(50, 12).data(), 12);
  for (const std::string id : {"b", "c", "d"}) {
    const auto prompt = conversation(60, 9);
    auto lease = mgr->acquire(id);
    ASSERT_EQ(share(*mgr, *lease, prompt), 6);
    lease->release();
    commit(*mgr, id, conversation(70, 10));  // each writes its own tail over the prefix
  }
  // 6 shared tokens once, then tails of 6 (a) and 4 (b, c, d).
  EXPECT_EQ(mgr->stats().resident_bytes, (6 + 6 + 3 * 4) * per_token);
  // a still reads exactly what it committed.
  const auto a_now = mgr->find("a")->export_prefix(conversation(50, 12).data(), 12);
  ASSERT_TRUE(a_now && a_keys);
  for (size_t i = 0; i < a_now->states.size(); ++i) {
    EXPECT_TRUE(at::equal(a_now->states[i]->tensors()[0], a_keys->states[i]->tensors()[0]));
  }
}

TEST(SharedPrefixManager, LongConversationsKeepTheirOwnCopyRatherThanCopyTheirTail) {
  auto mgr = sharing_manager();
  commit(*mgr, "a", conversation(50, 12));
  const auto prompt = conversation(60, 9);
  {
    auto lease = mgr->acquire("b");
    ASSERT_EQ(share(*mgr, *lease, prompt), 6);
  }
  commit(*mgr, "b", conversation(60, 12));  // 6 own tokens: rebased on the prefix
  auto layer = [&](int64_t n) {
    auto s = mgr->find("b");
    return std::static_pointer_cast<AttentionState>(
        s->layers_for(s->plan(conversation(60, n).data(), n))[0]);
  };
  EXPECT_EQ(layer(12)->prefix_tokens(), 6);
  commit(*mgr, "b", conversation(60, 13));  // 7 own tokens > 6 shared: keeps its arena
  EXPECT_EQ(layer(13)->prefix_tokens(), 0);
}

TEST(SharedPrefixManager, EvictingEverySharerFreesThePrefix) {
  auto mgr = sharing_manager();
  commit(*mgr, "a", conversation(50, 12));
  {
    const auto prompt = conversation(60, 9);
    auto lease = mgr->acquire("b");
    share(*mgr, *lease, prompt);
  }
  EXPECT_EQ(mgr->stats().shared_prefixes, 1);
  mgr->clear("a");
  mgr->clear("b");
  mgr->enforce_limits();
  EXPECT_EQ(mgr->stats().shared_prefixes, 0);
  EXPECT_EQ(mgr->stats().resident_bytes, 0);
}

TEST(SharedPrefixManager, AStateHeldOutsideTheSessionsDoesNotKeepThePrefix) {
  // A caller's cached_state() (or a queued tier write) holds layers sitting
  // on the prefix. Once no session holds it and no turn is in flight, the
  // manager drops it and counts nothing; the caller's copy stays readable.
  auto mgr = sharing_manager();
  commit(*mgr, "a", conversation(50, 12));
  {
    auto lease = mgr->acquire("b");
    share(*mgr, *lease, conversation(60, 9));
  }
  commit(*mgr, "b", conversation(60, 12));
  const auto held = mgr->find("b")->cached_state();
  mgr->clear("a");
  mgr->clear("b");
  mgr->enforce_limits();
  EXPECT_EQ(mgr->stats().shared_prefixes, 0);
  EXPECT_EQ(mgr->stats().resident_bytes, 0);
  ASSERT_EQ(held.layers.size(), 2u);
  EXPECT_EQ(held.layers[0]->num_tokens(), 12);
  EXPECT_EQ(held.layers[0]->tensors()[0].size(2), 12);
}

TEST(SharedPrefixManager, ATurnInFlightKeepsThePrefixItsPlanHolds) {
  // Between begin_turn and Turn::finish the layers are the plan's, not the
  // session's: a release elsewhere must not drop the prefix under them.
  auto mgr = sharing_manager();
  commit(*mgr, "a", conversation(50, 12));
  auto lease = mgr->acquire("b");
  ASSERT_EQ(share(*mgr, *lease, conversation(60, 9)), 6);
  const auto taken = lease->session()->take_cache();  // as begin_turn hands them out
  mgr->clear("a");
  mgr->enforce_limits();
  EXPECT_EQ(mgr->stats().shared_prefixes, 1);
}

TEST(SharedPrefixManager, TextWithoutMessageBoundariesSharesAtAMultipleOfTheMinimum) {
  // Text completions: a common header and no end-of-message token anywhere.
  auto mgr = sharing_manager();  // a minimum of 4 tokens
  std::vector<int64_t> header{20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30};
  auto text = [&](std::vector<int64_t> tail) {
    auto ids = header;
    ids.insert(ids.end(), tail.begin(), tail.end());
    return ids;
  };
  commit(*mgr, "a", text({40, 41, 42}));
  auto lease_b = mgr->acquire("b");
  EXPECT_EQ(share(*mgr, *lease_b, text({50, 51})), 8);  // 11 in common, cut at 8
  // A third text that differs later still lands on the same prefix.
  auto lease_c = mgr->acquire("c");
  EXPECT_EQ(share(*mgr, *lease_c, text({60, 61, 62})), 8);
  EXPECT_EQ(mgr->stats().shared_prefixes, 1);
  // Fewer tokens in common than the minimum: nothing.
  auto lease_d = mgr->acquire("d");
  EXPECT_EQ(share(*mgr, *lease_d, std::vector<int64_t>{20, 21, 22, 99, 98, 97}), 0);
}

TEST(SharedPrefixManager, NoShareBelowTheMinimumOrWhenOwnCacheIsBetter) {
  auto mgr = sharing_manager();
  commit(*mgr, "a", conversation(50, 12));
  commit(*mgr, "b", conversation(60, 9));
  const auto prompt = conversation(60, 10);  // b holds 9 of these itself
  auto lease = mgr->acquire("b");
  EXPECT_EQ(share(*mgr, *lease, prompt), 0);
  std::vector<int64_t> other{1, 2, 3, 4, 5, 6, 7};  // shares nothing with anyone
  auto lease_c = mgr->acquire("c");
  EXPECT_EQ(share(*mgr, *lease_c, other), 0);
}

}  // namespace
}  // namespace kvchat
