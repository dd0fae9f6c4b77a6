// One turn through the manager: begin_turn, the model's part (faked here),
// then Turn::finish, or Turn::abort (which the Turn's destructor does).
#include "kvchat/turn.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "kvchat/kv_buffer.h"
#include "kvchat/session_manager.h"
#include "test_util.h"

namespace kvchat {
namespace {

using testing::attention_layers;
using testing::iota_ids;
using testing::recurrent_layer;

const TurnMarkers kMarkers{{2}, {}};

std::shared_ptr<SessionManager> make_manager(
    bool prefill_checkpoints = false,
    CheckpointPlacement placement = CheckpointPlacement::kLastMessage) {
  return std::make_shared<SessionManager>(
      ManagerLimits{16, 0, 2}, TurnSettings{kMarkers, {}, prefill_checkpoints, placement});
}

// What a model would leave after `prompt` and `generated` new tokens: the
// sequence, and a cache of every token but the last.
TurnResult model_output(const std::vector<int64_t>& prompt, int64_t generated) {
  TurnResult result;
  result.sequence = prompt;
  for (int64_t i = 0; i < generated; ++i) result.sequence.push_back(500 + i);
  result.cached_tokens = static_cast<int64_t>(result.sequence.size()) - 1;
  result.layers = attention_layers(2, result.cached_tokens);
  result.messages = std::vector<Message>{{"user", "hi"}, {"assistant", "yo"}};
  return result;
}

TurnRecord run_turn(SessionManager& mgr, const std::string& id, const std::vector<int64_t>& prompt,
                    int64_t generated = 3) {
  auto lease = mgr.acquire(id);
  auto turn = mgr.begin_turn(*lease, prompt.data(), prompt.size(), 16);
  return turn.finish(model_output(prompt, generated));
}

// A session "a" after one turn on the ten ids `first`, leased for its next
// turn, whose prompt `next` adds one id.
class AfterOneTurn : public ::testing::Test {
 protected:
  void SetUp() override {
    run_turn(*mgr, "a", first);
    next.push_back(9);
    lease = mgr->acquire("a");
  }
  ChatSession& session() { return *lease->session(); }

  std::shared_ptr<SessionManager> mgr = make_manager();
  const std::vector<int64_t> first = iota_ids(10);
  std::vector<int64_t> next = iota_ids(10);
  std::unique_ptr<SessionLease> lease;
};

TEST(Turn, FirstTurnPrefillsAllAndCommits) {
  auto mgr = make_manager();
  const auto prompt = iota_ids(10);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto turn = mgr->begin_turn(*lease, prompt.data(), 10, 1000);
  const auto& plan = turn.plan();
  EXPECT_EQ(plan.reason, ReuseReason::kNoCache);
  EXPECT_EQ(plan.kept_tokens, 0);
  EXPECT_TRUE(plan.layers.empty());
  EXPECT_TRUE(plan.checkpoint_positions.empty());  // not asked for
  EXPECT_EQ(plan.reserve, KvBuffer::grown_capacity(10));
  auto record = turn.finish(model_output(prompt, 3));
  EXPECT_FALSE(turn.open());
  EXPECT_EQ(record.prompt_tokens, 10);
  EXPECT_EQ(record.reused_tokens, 0);
  EXPECT_EQ(record.prefilled_tokens, 10);
  EXPECT_EQ(record.generated_tokens, 3);
  EXPECT_EQ(record.output_ids, (std::vector<int64_t>{500, 501, 502}));
  EXPECT_TRUE(record.cache_stored);
  EXPECT_EQ(session.cached_ids().size(), 12u);
  EXPECT_EQ(session.messages().size(), 2u);
  ASSERT_TRUE(session.last_turn().has_value());
  EXPECT_EQ(session.counters().requests, 1);
}

TEST(Turn, NextTurnKeepsTheCacheAndTheSessionHandsItsLayersOver) {
  auto mgr = make_manager();
  auto prompt = iota_ids(10);
  run_turn(*mgr, "a", prompt);  // caches 12 tokens: the prompt, 500, 501
  prompt.insert(prompt.end(), {500, 501, 502, 7, 8});
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto turn = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
  auto& plan = turn.plan();
  EXPECT_EQ(plan.reason, ReuseReason::kExtend);
  EXPECT_EQ(plan.kept_tokens, 12);
  ASSERT_EQ(plan.layers.size(), 2u);
  EXPECT_EQ(plan.layers[0]->num_tokens(), 12);
  EXPECT_EQ(plan.reserve, 15 + 4);   // the whole turn fits in less than the growth step
  EXPECT_FALSE(session.resident());  // the turn holds the layers now
  auto layers = plan.take_layers();
  EXPECT_TRUE(plan.layers.empty());
  auto record = turn.finish(model_output(prompt, 2));
  EXPECT_EQ(record.reused_tokens, 12);
  EXPECT_EQ(record.prefilled_tokens, 3);
  EXPECT_EQ(session.cached_ids().size(), 16u);
}

TEST_F(AfterOneTurn, AbortLeavesTheHistoryAndNoCache) {
  const auto before = session().messages();
  auto turn = mgr->begin_turn(*lease, next.data(), next.size(), 4);
  turn.abort();  // say generate raised
  EXPECT_FALSE(turn.open());
  EXPECT_FALSE(session().resident());
  EXPECT_TRUE(session().cached_ids().empty());
  EXPECT_EQ(session().messages().size(), before.size());
  EXPECT_EQ(session().counters().requests, 1);  // the failed turn is not counted
}

TEST_F(AfterOneTurn, PlainTurnLeavesTheCacheAlone) {
  const auto ids = session().cached_ids();
  auto turn = mgr->begin_turn(*lease, first.data(), first.size(), 4, std::nullopt,
                              ReuseReason::kMultipleSequences);
  EXPECT_TRUE(turn.plan().plain);
  EXPECT_TRUE(turn.plan().layers.empty());
  EXPECT_TRUE(session().resident());
  auto record = turn.finish(model_output(first, 2));
  EXPECT_EQ(record.reason, ReuseReason::kMultipleSequences);
  EXPECT_EQ(record.reused_tokens, 0);
  EXPECT_EQ(record.prefilled_tokens, 10);
  EXPECT_FALSE(record.cache_stored);
  EXPECT_EQ(session().cached_ids(), ids);
  // A plain turn that failed keeps the cache too.
  mgr->begin_turn(*lease, first.data(), first.size(), 4, std::nullopt,
                  ReuseReason::kMultipleSequences)
      .abort();
  EXPECT_EQ(session().cached_ids(), ids);
}

TEST(Turn, ACacheThatDoesNotMatchTheSequenceIsDropped) {
  auto mgr = make_manager();
  const auto prompt = iota_ids(10);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto turn = mgr->begin_turn(*lease, prompt.data(), 10, 4);
  auto result = model_output(prompt, 3);
  result.cached_tokens -= 1;
  result.layers = attention_layers(2, result.cached_tokens);
  auto record = turn.finish(std::move(result));
  EXPECT_FALSE(record.cache_stored);
  EXPECT_FALSE(session.resident());
  EXPECT_EQ(session.messages().size(), 2u);  // the reply is still history
}

TEST_F(AfterOneTurn, ACommitThatFailsInvalidatesAndThrows) {
  auto turn = mgr->begin_turn(*lease, next.data(), next.size(), 4);
  auto result = model_output(next, 2);
  result.layers = attention_layers(3, result.cached_tokens);  // the model has 2
  EXPECT_THROW(turn.finish(std::move(result)), c10::ValueError);
  EXPECT_FALSE(turn.open());  // a finish that throws aborts
  EXPECT_FALSE(session().resident());
  EXPECT_EQ(session().counters().requests, 1);
  lease.reset();
  run_turn(*mgr, "a", next);
  lease = mgr->acquire("a");
  auto again = mgr->begin_turn(*lease, next.data(), next.size(), 4);
  auto wrong = model_output(iota_ids(11, 7), 2);  // not this plan's prompt
  EXPECT_THROW(again.finish(std::move(wrong)), c10::ValueError);
  EXPECT_FALSE(again.open());
  EXPECT_FALSE(lease->session()->resident());  // checked first, then aborted
  EXPECT_EQ(lease->session()->counters().requests, 2);
}

TEST(Turn, AReloadedCacheIsRestoredOrRefused) {
  auto mgr = make_manager();
  const auto prompt = iota_ids(10);
  CachedState good{iota_ids(8), attention_layers(2, 8), {}, "", 8};
  auto lease = mgr->acquire("a");
  auto turn = mgr->begin_turn(*lease, prompt.data(), 10, 4, good);
  EXPECT_EQ(turn.plan().reason, ReuseReason::kTierReload);
  EXPECT_EQ(turn.plan().kept_tokens, 8);
  EXPECT_TRUE(turn.plan().reload_error.empty());
  turn.abort();

  CachedState bad{iota_ids(8), attention_layers(3, 8), {}, "", 8};
  turn = mgr->begin_turn(*lease, prompt.data(), 10, 4, bad);
  const auto& plan = turn.plan();
  EXPECT_EQ(plan.reason, ReuseReason::kNoCache);
  EXPECT_EQ(plan.kept_tokens, 0);
  EXPECT_NE(plan.reload_error.find("layers"), std::string::npos) << plan.reload_error;
  turn.abort();

  // A shared store's snapshot reports as the store's, and nothing else is a reload.
  turn = mgr->begin_turn(*lease, prompt.data(), 10, 4, good, std::nullopt, 0,
                         ReuseReason::kStoreReload);
  EXPECT_EQ(turn.plan().reason, ReuseReason::kStoreReload);
  turn.abort();
  EXPECT_THROW(
      mgr->begin_turn(*lease, prompt.data(), 10, 4, good, std::nullopt, 0, ReuseReason::kExtend),
      c10::ValueError);
}

TEST(Turn, CheckpointPositionsCoverTheUncachedTail) {
  auto mgr = make_manager(/*prefill_checkpoints=*/true, CheckpointPlacement::kEveryMessage);
  std::vector<int64_t> prompt{10, 11, 2, 12, 13, 2, 14, 15};
  auto lease = mgr->acquire("a");
  auto turn = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
  const auto& plan = turn.plan();
  // After each end-of-turn id, and before the last prompt token.
  EXPECT_EQ(plan.checkpoint_positions, (std::vector<int64_t>{3, 6, 7}));
  EXPECT_FALSE(plan.snapshot_prompt_end);
  EXPECT_TRUE(plan.checkpoints.empty());
}

TEST(Turn, LastMessagePlacementTakesTheTurnsStartForFree) {
  auto mgr = make_manager(/*prefill_checkpoints=*/true);
  const auto prompt = iota_ids(10);
  {
    auto lease = mgr->acquire("a");
    auto turn = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
    EXPECT_TRUE(turn.plan().snapshot_prompt_end);
    EXPECT_TRUE(turn.plan().checkpoints.empty());  // nothing cached: no start to keep
    auto result = model_output(prompt, 3);
    result.layers = {recurrent_layer(result.cached_tokens), recurrent_layer(result.cached_tokens)};
    turn.finish(std::move(result));
  }
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  // The next prompt extends the 12 cached tokens (the prompt, 2 generated).
  auto next = iota_ids(10);
  for (int64_t id : {500, 501, 7}) next.push_back(id);
  auto turn = mgr->begin_turn(*lease, next.data(), next.size(), 4);
  auto& plan = turn.plan();
  ASSERT_EQ(plan.kept_tokens, 12);
  ASSERT_EQ(plan.checkpoints.size(), 1u);
  const auto& start = plan.checkpoints[0];
  EXPECT_EQ(start.position, 12);
  ASSERT_EQ(start.states.size(), 2u);
  // The layers the turn starts from, shared (no copy).
  const auto layers = plan.take_layers();
  EXPECT_TRUE(start.states[0]->tensors()[0].is_same(layers[0]->tensors()[0]));
  auto result = model_output(next, 2);
  result.layers = {recurrent_layer(result.cached_tokens), recurrent_layer(result.cached_tokens)};
  turn.finish(std::move(result));
  EXPECT_EQ(session.cache_info().checkpoint_positions, (std::vector<int64_t>{12}));
}

TEST_F(AfterOneTurn, BadArgumentsAreRefusedBeforeAnythingChanges) {
  const auto& prompt = first;
  auto& session = this->session();
  EXPECT_THROW(mgr->begin_turn(*lease, prompt.data(), 0, 4), c10::ValueError);
  EXPECT_THROW(mgr->begin_turn(*lease, prompt.data(), 10, 0), c10::ValueError);
  EXPECT_TRUE(session.resident());
  // A turn begins only under a lease of this manager's that is still held.
  auto other = make_manager();
  auto foreign = other->acquire("a");
  EXPECT_THROW(mgr->begin_turn(*foreign, prompt.data(), 10, 4), c10::ValueError);
  lease->release();
  EXPECT_THROW(mgr->begin_turn(*lease, prompt.data(), 10, 4), c10::Error);
  EXPECT_TRUE(session.resident());
  EXPECT_THROW(SessionManager(ManagerLimits{}, TurnSettings{TurnMarkers{{-1}, {}}}),
               c10::ValueError);
}

// The Turn is RAII: what it does when it dies, and what it refuses.

// A session "a" after one turn of a model with checkpoints, so a turn that
// takes its layers leaves it holding checkpoints that only an abort drops.
std::shared_ptr<SessionManager> after_a_hybrid_turn(const std::string& id = "a") {
  auto mgr = make_manager(/*prefill_checkpoints=*/true);
  auto lease = mgr->acquire(id);
  const auto prompt = iota_ids(10);
  auto turn = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
  auto result = model_output(prompt, 3);
  result.layers = {recurrent_layer(12), recurrent_layer(12)};
  result.checkpoints = {Checkpoint{10, {recurrent_layer(10), recurrent_layer(10)}}};
  turn.finish(std::move(result));
  return mgr;
}

std::vector<int64_t> next_prompt() {
  auto next = iota_ids(10);
  next.insert(next.end(), {500, 501, 7});
  return next;
}

TEST(Turn, ATurnDestroyedUnfinishedAbortsIt) {
  // One session aborts explicitly, the other's turn just dies: the same state.
  auto mgr = after_a_hybrid_turn();
  const auto prompt = next_prompt();
  auto explicit_lease = mgr->acquire("a");
  auto& aborted = *explicit_lease->session();
  auto turn = mgr->begin_turn(*explicit_lease, prompt.data(), prompt.size(), 4);
  EXPECT_EQ(aborted.cache_info().checkpoints, 1);  // the layers went, checkpoints stay
  turn.abort();

  auto other = after_a_hybrid_turn("b");
  auto lease = other->acquire("b");
  auto& session = *lease->session();
  const auto history = session.messages().size();
  {
    auto dropped = other->begin_turn(*lease, prompt.data(), prompt.size(), 4);
    EXPECT_TRUE(dropped.open());
    EXPECT_FALSE(dropped.plan().layers.empty());
    EXPECT_EQ(session.cache_info().checkpoints, 1);
  }  // say the adapter threw before finish
  for (ChatSession* s : {&aborted, &session}) {
    EXPECT_FALSE(s->resident());
    EXPECT_TRUE(s->cached_ids().empty());
    EXPECT_EQ(s->cache_info().checkpoints, 0);
    EXPECT_EQ(s->messages().size(), history);
    EXPECT_EQ(s->counters().requests, 1);  // the failed turn is not counted
  }
}

TEST(Turn, AFinishedTurnsDestructionDoesNothingMore) {
  auto mgr = after_a_hybrid_turn();
  const auto prompt = next_prompt();
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  uint64_t version = 0;
  {
    auto turn = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
    auto result = model_output(prompt, 2);
    result.layers = {recurrent_layer(14), recurrent_layer(14)};
    EXPECT_TRUE(turn.finish(std::move(result)).cache_stored);
    version = session.version();
    turn.abort();  // nothing once finished
    EXPECT_EQ(session.version(), version);
  }
  EXPECT_EQ(session.version(), version);
  EXPECT_EQ(session.cached_ids().size(), 14u);
  EXPECT_EQ(session.counters().requests, 2);
}

TEST(Turn, ATurnIsFinishedOnceAndNeverAfterAnAbort) {
  auto mgr = make_manager();
  const auto prompt = iota_ids(10);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto turn = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
  turn.finish(model_output(prompt, 3));
  const auto version = session.version();
  try {
    turn.finish(model_output(prompt, 3));
    ADD_FAILURE() << "a second finish did not throw";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("already finished"), std::string::npos);
  }
  EXPECT_EQ(session.version(), version);  // the second finish changed nothing
  EXPECT_EQ(session.counters().requests, 1);

  auto next = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
  next.abort();
  next.abort();  // idempotent
  EXPECT_THROW(next.finish(model_output(prompt, 3)), c10::Error);
  EXPECT_FALSE(session.resident());
  EXPECT_EQ(session.counters().requests, 1);
}

TEST_F(AfterOneTurn, AMovedFromTurnsDestructionDoesNothing) {
  const auto& prompt = next;
  auto& session = this->session();
  std::optional<Turn> moved_to;
  {
    auto turn = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
    const auto version = session.version();
    moved_to.emplace(std::move(turn));
    EXPECT_FALSE(turn.open());  // NOLINT(bugprone-use-after-move): what is left
    EXPECT_TRUE(moved_to->open());
    EXPECT_EQ(moved_to->plan().kept_tokens, 10);
    EXPECT_THROW(turn.finish(model_output(prompt, 2)), c10::Error);
    turn.abort();  // nothing: it holds no turn
    EXPECT_EQ(session.version(), version);
  }
  EXPECT_TRUE(moved_to->open());
  EXPECT_TRUE(moved_to->finish(model_output(prompt, 2)).cache_stored);
  EXPECT_EQ(session.cached_ids().size(), 12u);

  // Assigning over an open turn aborts it first, as a destruction would.
  auto other = mgr->acquire("b");
  run_turn(*mgr, "c", prompt);
  auto c = mgr->acquire("c");
  auto replaced = mgr->begin_turn(*c, prompt.data(), prompt.size(), 4);
  const auto taken = c->session()->version();
  replaced = mgr->begin_turn(*other, prompt.data(), prompt.size(), 4);
  EXPECT_NE(c->session()->version(), taken);  // aborted: the cache it left was dropped
  EXPECT_TRUE(replaced.open());
}

TEST_F(AfterOneTurn, ATurnThatOutlivesItsLeaseDropsNoLaterCache) {
  auto stale = mgr->begin_turn(*lease, next.data(), next.size(), 4);
  lease.reset();                 // let go with the turn still open (a caller's bug)
  run_turn(*mgr, "a", next, 2);  // the next turn commits
  const auto held = mgr->find("a")->cached_ids();
  EXPECT_EQ(held.size(), 12u);
  stale.abort();  // the session moved on: its cache is not this turn's to drop
  EXPECT_EQ(mgr->find("a")->cached_ids(), held);
}

// Settling: the session after a turn (12 tokens cached: the prompt 100..109,
// then 500, 501) brought to the ids its next prompt is predicted to start
// with, here a re-tokenized reply: 100..109, 900, 901, 902, 2.
std::vector<int64_t> settle_target() {
  auto target = iota_ids(10);
  target.insert(target.end(), {900, 901, 902, 2});
  return target;
}

SettleResult settled(int64_t tokens) {
  return SettleResult{tokens, attention_layers(2, tokens), {}};
}

TEST_F(AfterOneTurn, SettlingKeepsTheSessionsCacheUntilItCommits) {
  const auto target = settle_target();
  auto& session = this->session();
  auto plan = mgr->begin_settle(*lease, target.data(), target.size());
  EXPECT_EQ(plan.kept_tokens, 10);  // the reply departs at its first token
  EXPECT_TRUE(plan.needed());
  EXPECT_EQ(plan.version, session.version());
  ASSERT_EQ(plan.layers.size(), 2u);
  EXPECT_EQ(plan.layers[0]->num_tokens(), 10);
  // The session still holds its own cache: a turn could run on it meanwhile.
  EXPECT_EQ(session.cached_ids().size(), 12u);
  EXPECT_TRUE(mgr->finish_settle(*lease, plan, settled(14)));
  EXPECT_EQ(session.cached_ids(), target);
  EXPECT_NE(session.version(), plan.version);
  EXPECT_EQ(session.counters().settles, 1);
  EXPECT_EQ(session.counters().settled_tokens, 4);
  EXPECT_EQ(session.counters().requests, 1);  // a settle is no turn
  // Held now: a second settle to the same target has nothing to do.
  EXPECT_FALSE(mgr->begin_settle(*lease, target.data(), target.size()).needed());
  // Only under a lease of this manager's that is still held, as a turn.
  auto other = make_manager();
  auto foreign = other->acquire("a");
  EXPECT_THROW(mgr->begin_settle(*foreign, target.data(), target.size()), c10::ValueError);
  EXPECT_THROW(mgr->finish_settle(*foreign, plan, settled(14)), c10::ValueError);
  lease->release();
  EXPECT_THROW(mgr->begin_settle(*lease, target.data(), target.size()), c10::Error);
}

TEST(Turn, ASettlePlannedFromACacheThatChangedIsNotCommitted) {
  auto mgr = make_manager();
  run_turn(*mgr, "a", iota_ids(10));
  const auto target = settle_target();
  SettlePlan plan;
  {
    auto lease = mgr->acquire("a");
    plan = mgr->begin_settle(*lease, target.data(), target.size());
  }
  auto next = iota_ids(10);
  next.insert(next.end(), {500, 501, 7});
  run_turn(*mgr, "a", next);  // a turn took over before the settle was done
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  const auto held = session.cached_ids();
  EXPECT_FALSE(mgr->finish_settle(*lease, plan, settled(14)));
  EXPECT_EQ(session.cached_ids(), held);
  EXPECT_EQ(session.counters().settles, 0);
  // Nor onto a session of the same id made anew.
  lease.reset();
  mgr->remove("a");
  run_turn(*mgr, "a", iota_ids(10));
  lease = mgr->acquire("a");
  EXPECT_FALSE(mgr->finish_settle(*lease, plan, settled(14)));
}

TEST_F(AfterOneTurn, APartialSettleCommitsWhatItPrefilled) {
  const auto target = settle_target();
  auto& session = this->session();
  auto plan = mgr->begin_settle(*lease, target.data(), target.size());
  EXPECT_THROW(mgr->finish_settle(*lease, plan, settled(10)), c10::ValueError);
  EXPECT_THROW(mgr->finish_settle(*lease, plan, settled(15)), c10::ValueError);
  EXPECT_TRUE(mgr->finish_settle(*lease, plan, settled(12)));
  EXPECT_EQ(session.cached_ids(), std::vector<int64_t>(target.begin(), target.begin() + 12));
}

TEST(Turn, SettlingAHybridRestoresTheCheckpointBeforeTheDeparture) {
  auto mgr = make_manager(true);
  // The first turn's checkpoints: the prompt's end (10), from generate.
  auto first = iota_ids(10);
  {
    auto lease = mgr->acquire("a");
    auto turn = mgr->begin_turn(*lease, first.data(), first.size(), 4);
    auto result = model_output(first, 3);
    result.layers = {recurrent_layer(12), recurrent_layer(12)};
    result.checkpoints = {Checkpoint{10, {recurrent_layer(10), recurrent_layer(10)}}};
    turn.finish(std::move(result));
  }
  const auto target = settle_target();
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_settle(*lease, target.data(), target.size());
  EXPECT_EQ(plan.kept_tokens, 10);
  EXPECT_EQ(plan.checkpoint_restored, 10);
  ASSERT_EQ(plan.layers.size(), 2u);
  EXPECT_EQ(plan.layers[1]->num_tokens(), 10);
  SettleResult result{14, {recurrent_layer(14), recurrent_layer(14)}, {}};
  EXPECT_TRUE(mgr->finish_settle(*lease, plan, std::move(result)));
  // The checkpoint it started from stays, for a prediction that missed.
  EXPECT_EQ(session.cache_info().checkpoint_positions, (std::vector<int64_t>{10}));
}

TEST(Turn, ThinningKeepsTheCheckpointTheTurnSaysTheNextOneNeeds) {
  auto mgr = std::make_shared<SessionManager>(ManagerLimits{16, 0, 2, CheckpointPolicy{1, 0}},
                                              TurnSettings{kMarkers, {}, true});
  const auto prompt = iota_ids(10);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto turn = mgr->begin_turn(*lease, prompt.data(), prompt.size(), 4);
  auto result = model_output(prompt, 3);
  result.layers = {recurrent_layer(12), recurrent_layer(12)};
  // A template that renders the generation prompt's last two tokens otherwise.
  result.checkpoints = {Checkpoint{8, {recurrent_layer(8), recurrent_layer(8)}},
                        Checkpoint{10, {recurrent_layer(10), recurrent_layer(10)}}};
  result.needed_checkpoint = 9;
  turn.finish(std::move(result));
  EXPECT_EQ(session.cache_info().checkpoint_positions, (std::vector<int64_t>{8}));
}

}  // namespace
}  // namespace kvchat
