#include "kvchat/session_manager.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <atomic>
#include <thread>

#include "test_util.h"

namespace kvchat {
namespace {

using testing::attention_layers;
using testing::iota_ids;

const TurnMarkers kMarkers{{2}, {}};

std::shared_ptr<SessionManager> make_manager(int64_t max_sessions, int64_t max_bytes = 0) {
  return std::make_shared<SessionManager>(ManagerLimits{max_sessions, max_bytes, 2});
}

void fill(SessionManager& mgr, const std::string& id, int64_t tokens) {
  auto lease = mgr.acquire(id);
  auto ids = iota_ids(tokens);
  lease->session()->commit(ids.data(), tokens, attention_layers(2, tokens), 0, kMarkers,
                           RepetitionRule{});
}

// Bytes of one session of `tokens` tokens made by attention_layers(2, tokens).
int64_t session_bytes(int64_t tokens) { return 2 * 2 * tokens * 2 * 4 * sizeof(float); }

TEST(SessionManager, LruByCountKeepsMessages) {
  auto mgr = make_manager(2);
  fill(*mgr, "a", 4);
  mgr->find("a")->add_message("user", "hi");
  fill(*mgr, "b", 4);
  fill(*mgr, "c", 4);  // evicts a, the least recently used
  EXPECT_FALSE(mgr->find("a")->resident());
  EXPECT_TRUE(mgr->find("b")->resident());
  EXPECT_TRUE(mgr->find("c")->resident());
  EXPECT_EQ(mgr->find("a")->messages().size(), 1u);
  EXPECT_EQ(mgr->stats().evictions, 1);
  EXPECT_EQ(mgr->stats().resident_sessions, 2);
}

TEST(SessionManager, LruOrderFollowsUse) {
  auto mgr = make_manager(2);
  fill(*mgr, "a", 4);
  fill(*mgr, "b", 4);
  {
    auto touch = mgr->acquire("a");
  }
  fill(*mgr, "c", 4);  // b is now the least recently used
  EXPECT_TRUE(mgr->find("a")->resident());
  EXPECT_FALSE(mgr->find("b")->resident());
  EXPECT_EQ(mgr->session_ids(), (std::vector<std::string>{"b", "a", "c"}));
}

TEST(SessionManager, ALeaseThatDoesNotTouchLeavesTheLruOrder) {
  auto mgr = make_manager(2);
  fill(*mgr, "a", 4);
  fill(*mgr, "b", 4);
  {
    auto background = mgr->acquire("a", true, true, false);
  }
  fill(*mgr, "c", 4);  // a is still the least recently used
  EXPECT_FALSE(mgr->find("a")->resident());
  EXPECT_TRUE(mgr->find("b")->resident());
}

TEST(SessionManager, LruByBytes) {
  auto mgr = make_manager(100, session_bytes(10) * 2);
  fill(*mgr, "a", 10);
  fill(*mgr, "b", 10);
  EXPECT_EQ(mgr->stats().resident_bytes, session_bytes(10) * 2);
  fill(*mgr, "c", 10);
  EXPECT_FALSE(mgr->find("a")->resident());
  EXPECT_LE(mgr->stats().resident_bytes, session_bytes(10) * 2);
}

TEST(SessionManager, NeverEvictsASessionInUse) {
  auto mgr = make_manager(1);
  fill(*mgr, "a", 4);
  auto held = mgr->acquire("a");
  fill(*mgr, "b", 4);  // over the limit, but a is in use: b itself goes once released
  EXPECT_TRUE(mgr->find("a")->resident());
  EXPECT_FALSE(mgr->find("b")->resident());
  held->release();
  EXPECT_EQ(mgr->stats().resident_sessions, 1);
}

TEST(SessionManager, ReservedBytesCountTowardTheByteBudget) {
  auto mgr = make_manager(100, session_bytes(10) * 3);
  fill(*mgr, "a", 10);
  fill(*mgr, "b", 10);
  fill(*mgr, "c", 10);
  EXPECT_EQ(mgr->stats().evictions, 0);
  // A batch's buffers as big as one session: the least recently used goes.
  mgr->set_reserved_bytes(session_bytes(10));
  EXPECT_FALSE(mgr->find("a")->resident());
  EXPECT_TRUE(mgr->find("b")->resident());
  EXPECT_TRUE(mgr->find("c")->resident());
  auto stats = mgr->stats();
  EXPECT_EQ(stats.evictions, 1);
  EXPECT_EQ(stats.reserved_bytes, session_bytes(10));
  EXPECT_EQ(stats.resident_bytes, session_bytes(10) * 2);  // reserved bytes are not resident
  EXPECT_EQ(mgr->reserved_bytes(), session_bytes(10));
  // Still reserved: a new session's turn pushes the next LRU one out.
  fill(*mgr, "d", 10);
  EXPECT_FALSE(mgr->find("b")->resident());
  EXPECT_EQ(mgr->stats().evictions, 2);
  // Freed: nothing more goes, and the next session fits beside the others.
  mgr->set_reserved_bytes(0);
  fill(*mgr, "e", 10);
  EXPECT_TRUE(mgr->find("c")->resident());
  EXPECT_TRUE(mgr->find("d")->resident());
  EXPECT_TRUE(mgr->find("e")->resident());
  EXPECT_EQ(mgr->stats().evictions, 2);
  EXPECT_EQ(mgr->stats().reserved_bytes, 0);
}

TEST(SessionManager, ReservedBytesNeverEvictALeasedSession) {
  auto mgr = make_manager(100, session_bytes(10) * 2);
  fill(*mgr, "a", 10);
  fill(*mgr, "b", 10);
  auto held = mgr->acquire("a");  // a is now the most recently used, and leased
  mgr->set_reserved_bytes(session_bytes(10) * 2);
  EXPECT_TRUE(mgr->find("a")->resident());
  EXPECT_FALSE(mgr->find("b")->resident());
  auto stats = mgr->stats();
  EXPECT_EQ(stats.evictions, 1);
  EXPECT_EQ(stats.resident_bytes + stats.reserved_bytes, session_bytes(10) * 3);  // over, leased
  // Once released, a is idle and over the budget, so it goes too.
  held->release();
  EXPECT_FALSE(mgr->find("a")->resident());
  EXPECT_EQ(mgr->stats().evictions, 2);
}

TEST(SessionManager, ReservedBytesEvictionsAreKeptForSpilling) {
  ManagerLimits limits{100, session_bytes(10) * 2, 2};
  limits.keep_evicted = true;
  auto mgr = std::make_shared<SessionManager>(limits);
  fill(*mgr, "a", 10);
  fill(*mgr, "b", 10);
  mgr->set_reserved_bytes(session_bytes(10));
  auto evicted = mgr->take_evicted();
  ASSERT_EQ(evicted.size(), 1u);
  EXPECT_EQ(evicted[0].id, "a");
  EXPECT_FALSE(evicted[0].state.layers.empty());
  EXPECT_FALSE(mgr->find("a")->resident());
}

TEST(SessionManager, AnEvictedCacheWaitingForItsSpillGoesWithItsSession) {
  ManagerLimits limits{100, session_bytes(10) * 3, 2};
  limits.keep_evicted = true;
  auto mgr = std::make_shared<SessionManager>(limits);
  fill(*mgr, "a", 10);
  fill(*mgr, "b", 10);
  fill(*mgr, "c", 10);
  mgr->set_reserved_bytes(session_bytes(10) * 2);  // a and b evicted, not yet spilled
  mgr->remove("a");
  mgr->clear("b");
  EXPECT_TRUE(mgr->take_evicted().empty());  // neither reaches the spill
  EXPECT_TRUE(mgr->find("c")->resident());
}

TEST(SessionManager, ReservedBytesWithoutAByteBudgetEvictNothing) {
  auto mgr = make_manager(100);
  fill(*mgr, "a", 10);
  mgr->set_reserved_bytes(session_bytes(10) * 1000);
  EXPECT_TRUE(mgr->find("a")->resident());
  EXPECT_EQ(mgr->stats().reserved_bytes, session_bytes(10) * 1000);
  EXPECT_THROW(mgr->set_reserved_bytes(-1), c10::ValueError);
  EXPECT_EQ(mgr->reserved_bytes(), session_bytes(10) * 1000);  // a refused value changes nothing
}

TEST(SessionManager, UnknownIdsAndBusySessions) {
  auto mgr = make_manager(4);
  EXPECT_THROW(mgr->find("nobody"), UnknownSessionError);
  EXPECT_THROW(mgr->remove("nobody"), UnknownSessionError);
  EXPECT_THROW(mgr->acquire(""), c10::ValueError);
  auto held = mgr->acquire("a");
  EXPECT_THROW(mgr->acquire("a", /*wait=*/false), SessionBusyError);
  EXPECT_THROW(mgr->remove("a"), SessionBusyError);
  held->release();
  mgr->remove("a");
  EXPECT_FALSE(mgr->contains("a"));
}

TEST(SessionManager, StatsSurviveRemoval) {
  auto mgr = make_manager(4);
  {
    auto lease = mgr->acquire("a");
    TurnRecord turn;
    turn.reused_tokens = 30;
    turn.prefilled_tokens = 10;
    lease->session()->record_turn(turn);
  }
  mgr->remove("a");
  auto stats = mgr->stats();
  EXPECT_EQ(stats.totals.requests, 1);
  EXPECT_DOUBLE_EQ(stats.hit_rate(), 0.75);
  EXPECT_EQ(stats.sessions, 0);
}

TEST(SessionManager, ConcurrentTurnsOnManySessions) {
  auto mgr = make_manager(6, session_bytes(8) * 5);
  constexpr int kThreads = 8;
  constexpr int kTurns = 50;
  std::atomic<int> in_session_a{0};
  std::atomic<bool> overlap{false};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int turn = 0; turn < kTurns; ++turn) {
        // Every thread also collides on session "a".
        const std::string id = turn % 3 == 0 ? "a" : "s" + std::to_string((t + turn) % 12);
        auto lease = mgr->acquire(id);
        if (id == "a" && in_session_a.fetch_add(1) != 0) overlap = true;
        auto ids = iota_ids(8, 1000 * t);
        lease->session()->commit(ids.data(), 8, attention_layers(2, 8), 0, kMarkers,
                                 RepetitionRule{});
        auto plan = lease->session()->plan(ids.data(), 8);
        EXPECT_EQ(plan.kept_tokens, 7);  // only this turn's own ids are visible
        if (id == "a") in_session_a.fetch_sub(1);
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_FALSE(overlap) << "two turns ran on one session at once";
  auto stats = mgr->stats();
  EXPECT_LE(stats.resident_sessions, 6);
  EXPECT_LE(stats.resident_bytes, session_bytes(8) * 5);
}

TEST(SessionManager, RejectsBadLimits) {
  EXPECT_THROW(SessionManager(ManagerLimits{0, 0, 0}), c10::ValueError);
  EXPECT_THROW(SessionManager(ManagerLimits{1, -5, 0}), c10::ValueError);
  EXPECT_THROW(SessionManager(ManagerLimits{1, 0, -1}), c10::ValueError);
  EXPECT_THROW(SessionManager(ManagerLimits{1, 0, 0, CheckpointPolicy{-1, 0}}), c10::ValueError);
  EXPECT_THROW(SessionManager(ManagerLimits{1, 0, 0, CheckpointPolicy{8, -1}}), c10::ValueError);
  EXPECT_THROW(SessionManager(ManagerLimits{1, 0, 0, {}, -1}), c10::ValueError);
  EXPECT_NO_THROW(SessionManager(ManagerLimits{1, 0, 0, CheckpointPolicy{0, 0}, 0}));
}

}  // namespace
}  // namespace kvchat
