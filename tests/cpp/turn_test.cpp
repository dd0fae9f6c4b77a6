// One turn through the manager: begin_turn, the model's part (faked here),
// then finish_turn or abort_turn.
#include "kvchat/turn.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

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
  auto& session = *lease->session();
  auto plan = mgr.begin_turn(session, prompt.data(), prompt.size(), 16);
  return mgr.finish_turn(session, plan, model_output(prompt, generated));
}

TEST(Turn, FirstTurnPrefillsAllAndCommits) {
  auto mgr = make_manager();
  const auto prompt = iota_ids(10);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_turn(session, prompt.data(), 10, 1000);
  EXPECT_EQ(plan.reason, ReuseReason::kNoCache);
  EXPECT_EQ(plan.kept_tokens, 0);
  EXPECT_TRUE(plan.layers.empty());
  EXPECT_TRUE(plan.checkpoint_positions.empty());  // not asked for
  EXPECT_EQ(plan.reserve, KvBuffer::grown_capacity(10));
  auto record = mgr->finish_turn(session, plan, model_output(prompt, 3));
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
  auto plan = mgr->begin_turn(session, prompt.data(), prompt.size(), 4);
  EXPECT_EQ(plan.reason, ReuseReason::kExtend);
  EXPECT_EQ(plan.kept_tokens, 12);
  ASSERT_EQ(plan.layers.size(), 2u);
  EXPECT_EQ(plan.layers[0]->num_tokens(), 12);
  EXPECT_EQ(plan.reserve, 15 + 4);   // the whole turn fits in less than the growth step
  EXPECT_FALSE(session.resident());  // the turn holds the layers now
  auto layers = plan.take_layers();
  EXPECT_TRUE(plan.layers.empty());
  auto record = mgr->finish_turn(session, plan, model_output(prompt, 2));
  EXPECT_EQ(record.reused_tokens, 12);
  EXPECT_EQ(record.prefilled_tokens, 3);
  EXPECT_EQ(session.cached_ids().size(), 16u);
}

TEST(Turn, AbortLeavesTheHistoryAndNoCache) {
  auto mgr = make_manager();
  auto prompt = iota_ids(10);
  run_turn(*mgr, "a", prompt);
  prompt.push_back(9);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  const auto before = session.messages();
  auto plan = mgr->begin_turn(session, prompt.data(), prompt.size(), 4);
  mgr->abort_turn(session, plan);  // say generate raised
  EXPECT_FALSE(session.resident());
  EXPECT_TRUE(session.cached_ids().empty());
  EXPECT_EQ(session.messages().size(), before.size());
  EXPECT_EQ(session.counters().requests, 1);  // the failed turn is not counted
}

TEST(Turn, PlainTurnLeavesTheCacheAlone) {
  auto mgr = make_manager();
  auto prompt = iota_ids(10);
  run_turn(*mgr, "a", prompt);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  const auto ids = session.cached_ids();
  auto plan = mgr->begin_turn(session, prompt.data(), prompt.size(), 4, std::nullopt,
                              ReuseReason::kMultipleSequences);
  EXPECT_TRUE(plan.plain);
  EXPECT_TRUE(plan.layers.empty());
  EXPECT_TRUE(session.resident());
  auto record = mgr->finish_turn(session, plan, model_output(prompt, 2));
  EXPECT_EQ(record.reason, ReuseReason::kMultipleSequences);
  EXPECT_EQ(record.reused_tokens, 0);
  EXPECT_EQ(record.prefilled_tokens, 10);
  EXPECT_FALSE(record.cache_stored);
  EXPECT_EQ(session.cached_ids(), ids);
  mgr->abort_turn(session, plan);  // a plain turn that failed keeps the cache too
  EXPECT_EQ(session.cached_ids(), ids);
}

TEST(Turn, ACacheThatDoesNotMatchTheSequenceIsDropped) {
  auto mgr = make_manager();
  const auto prompt = iota_ids(10);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_turn(session, prompt.data(), 10, 4);
  auto result = model_output(prompt, 3);
  result.cached_tokens -= 1;
  result.layers = attention_layers(2, result.cached_tokens);
  auto record = mgr->finish_turn(session, plan, std::move(result));
  EXPECT_FALSE(record.cache_stored);
  EXPECT_FALSE(session.resident());
  EXPECT_EQ(session.messages().size(), 2u);  // the reply is still history
}

TEST(Turn, ACommitThatFailsInvalidatesAndThrows) {
  auto mgr = make_manager();
  auto prompt = iota_ids(10);
  run_turn(*mgr, "a", prompt);
  prompt.push_back(9);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_turn(session, prompt.data(), prompt.size(), 4);
  auto result = model_output(prompt, 2);
  result.layers = attention_layers(3, result.cached_tokens);  // the model has 2
  EXPECT_THROW(mgr->finish_turn(session, plan, std::move(result)), c10::ValueError);
  EXPECT_FALSE(session.resident());
  EXPECT_EQ(session.counters().requests, 1);
  auto wrong = model_output(iota_ids(11, 7), 2);  // not this plan's prompt
  EXPECT_THROW(mgr->finish_turn(session, plan, std::move(wrong)), c10::ValueError);
}

TEST(Turn, AReloadedCacheIsRestoredOrRefused) {
  auto mgr = make_manager();
  const auto prompt = iota_ids(10);
  CachedState good{iota_ids(8), attention_layers(2, 8), {}, "", 8};
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_turn(session, prompt.data(), 10, 4, good);
  EXPECT_EQ(plan.reason, ReuseReason::kTierReload);
  EXPECT_EQ(plan.kept_tokens, 8);
  EXPECT_TRUE(plan.reload_error.empty());
  mgr->abort_turn(session, plan);

  CachedState bad{iota_ids(8), attention_layers(3, 8), {}, "", 8};
  plan = mgr->begin_turn(session, prompt.data(), 10, 4, bad);
  EXPECT_EQ(plan.reason, ReuseReason::kNoCache);
  EXPECT_EQ(plan.kept_tokens, 0);
  EXPECT_NE(plan.reload_error.find("layers"), std::string::npos) << plan.reload_error;
}

TEST(Turn, CheckpointPositionsCoverTheUncachedTail) {
  auto mgr = make_manager(/*prefill_checkpoints=*/true, CheckpointPlacement::kEveryMessage);
  std::vector<int64_t> prompt{10, 11, 2, 12, 13, 2, 14, 15};
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_turn(session, prompt.data(), prompt.size(), 4);
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
    auto& session = *lease->session();
    auto plan = mgr->begin_turn(session, prompt.data(), prompt.size(), 4);
    EXPECT_TRUE(plan.snapshot_prompt_end);
    EXPECT_TRUE(plan.checkpoints.empty());  // nothing cached: no start to keep
    auto result = model_output(prompt, 3);
    result.layers = {recurrent_layer(result.cached_tokens), recurrent_layer(result.cached_tokens)};
    mgr->finish_turn(session, plan, std::move(result));
  }
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  // The next prompt extends the 12 cached tokens (the prompt, 2 generated).
  auto next = iota_ids(10);
  for (int64_t id : {500, 501, 7}) next.push_back(id);
  auto plan = mgr->begin_turn(session, next.data(), next.size(), 4);
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
  mgr->finish_turn(session, plan, std::move(result));
  EXPECT_EQ(session.cache_info().checkpoint_positions, (std::vector<int64_t>{12}));
}

TEST(Turn, BadArgumentsAreRefusedBeforeAnythingChanges) {
  auto mgr = make_manager();
  const auto prompt = iota_ids(10);
  run_turn(*mgr, "a", prompt);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  EXPECT_THROW(mgr->begin_turn(session, prompt.data(), 0, 4), c10::ValueError);
  EXPECT_THROW(mgr->begin_turn(session, prompt.data(), 10, 0), c10::ValueError);
  EXPECT_TRUE(session.resident());
  EXPECT_THROW(SessionManager(ManagerLimits{}, TurnSettings{TurnMarkers{{-1}, {}}}),
               c10::ValueError);
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

TEST(Turn, SettlingKeepsTheSessionsCacheUntilItCommits) {
  auto mgr = make_manager();
  run_turn(*mgr, "a", iota_ids(10));
  const auto target = settle_target();
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_settle(session, target.data(), target.size());
  EXPECT_EQ(plan.kept_tokens, 10);  // the reply departs at its first token
  EXPECT_TRUE(plan.needed());
  EXPECT_EQ(plan.version, session.version());
  ASSERT_EQ(plan.layers.size(), 2u);
  EXPECT_EQ(plan.layers[0]->num_tokens(), 10);
  // The session still holds its own cache: a turn could run on it meanwhile.
  EXPECT_EQ(session.cached_ids().size(), 12u);
  EXPECT_TRUE(mgr->finish_settle(session, plan, settled(14)));
  EXPECT_EQ(session.cached_ids(), target);
  EXPECT_NE(session.version(), plan.version);
  EXPECT_EQ(session.counters().settles, 1);
  EXPECT_EQ(session.counters().settled_tokens, 4);
  EXPECT_EQ(session.counters().requests, 1);  // a settle is no turn
  // Held now: a second settle to the same target has nothing to do.
  EXPECT_FALSE(mgr->begin_settle(session, target.data(), target.size()).needed());
}

TEST(Turn, ASettlePlannedFromACacheThatChangedIsNotCommitted) {
  auto mgr = make_manager();
  run_turn(*mgr, "a", iota_ids(10));
  const auto target = settle_target();
  SettlePlan plan;
  {
    auto lease = mgr->acquire("a");
    plan = mgr->begin_settle(*lease->session(), target.data(), target.size());
  }
  auto next = iota_ids(10);
  next.insert(next.end(), {500, 501, 7});
  run_turn(*mgr, "a", next);  // a turn took over before the settle was done
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  const auto held = session.cached_ids();
  EXPECT_FALSE(mgr->finish_settle(session, plan, settled(14)));
  EXPECT_EQ(session.cached_ids(), held);
  EXPECT_EQ(session.counters().settles, 0);
  // Nor onto a session of the same id made anew.
  lease.reset();
  mgr->remove("a");
  run_turn(*mgr, "a", iota_ids(10));
  lease = mgr->acquire("a");
  EXPECT_FALSE(mgr->finish_settle(*lease->session(), plan, settled(14)));
}

TEST(Turn, APartialSettleCommitsWhatItPrefilled) {
  auto mgr = make_manager();
  run_turn(*mgr, "a", iota_ids(10));
  const auto target = settle_target();
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_settle(session, target.data(), target.size());
  EXPECT_THROW(mgr->finish_settle(session, plan, settled(10)), c10::ValueError);
  EXPECT_THROW(mgr->finish_settle(session, plan, settled(15)), c10::ValueError);
  EXPECT_TRUE(mgr->finish_settle(session, plan, settled(12)));
  EXPECT_EQ(session.cached_ids(), std::vector<int64_t>(target.begin(), target.begin() + 12));
}

TEST(Turn, SettlingAHybridRestoresTheCheckpointBeforeTheDeparture) {
  auto mgr = make_manager(true);
  // The first turn's checkpoints: the prompt's end (10), from generate.
  auto first = iota_ids(10);
  {
    auto lease = mgr->acquire("a");
    auto& session = *lease->session();
    auto plan = mgr->begin_turn(session, first.data(), first.size(), 4);
    auto result = model_output(first, 3);
    result.layers = {recurrent_layer(12), recurrent_layer(12)};
    result.checkpoints = {Checkpoint{10, {recurrent_layer(10), recurrent_layer(10)}}};
    mgr->finish_turn(session, plan, std::move(result));
  }
  const auto target = settle_target();
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_settle(session, target.data(), target.size());
  EXPECT_EQ(plan.kept_tokens, 10);
  EXPECT_EQ(plan.checkpoint_restored, 10);
  ASSERT_EQ(plan.layers.size(), 2u);
  EXPECT_EQ(plan.layers[1]->num_tokens(), 10);
  SettleResult result{14, {recurrent_layer(14), recurrent_layer(14)}, {}};
  EXPECT_TRUE(mgr->finish_settle(session, plan, std::move(result)));
  // The checkpoint it started from stays, for a prediction that missed.
  EXPECT_EQ(session.cache_info().checkpoint_positions, (std::vector<int64_t>{10}));
}

TEST(Turn, ThinningKeepsTheCheckpointTheTurnSaysTheNextOneNeeds) {
  auto mgr = std::make_shared<SessionManager>(
      ManagerLimits{16, 0, 2, CheckpointPolicy{1, 0}}, TurnSettings{kMarkers, {}, true});
  const auto prompt = iota_ids(10);
  auto lease = mgr->acquire("a");
  auto& session = *lease->session();
  auto plan = mgr->begin_turn(session, prompt.data(), prompt.size(), 4);
  auto result = model_output(prompt, 3);
  result.layers = {recurrent_layer(12), recurrent_layer(12)};
  // A template that renders the generation prompt's last two tokens otherwise.
  result.checkpoints = {Checkpoint{8, {recurrent_layer(8), recurrent_layer(8)}},
                        Checkpoint{10, {recurrent_layer(10), recurrent_layer(10)}}};
  result.needed_checkpoint = 9;
  mgr->finish_turn(session, plan, std::move(result));
  EXPECT_EQ(session.cache_info().checkpoint_positions, (std::vector<int64_t>{8}));
}

}  // namespace
}  // namespace kvchat
