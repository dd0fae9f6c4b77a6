#include "kvchat/chat_session.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace kvchat {
namespace {

using testing::attention_layers;
using testing::iota_ids;

const TurnMarkers kMarkers{{2}, {}};
const RepetitionRule kRule{8, 64};

TEST(ChatSession, SystemPromptIsKeptApartFromHistory) {
  ChatSession s("alice", 0);
  s.add_message("system", "be brief");
  s.add_message("user", "hi");
  s.add_message("assistant", "hello");
  EXPECT_EQ(s.messages().size(), 3u);
  s.clear_messages();
  auto kept = s.messages();
  ASSERT_EQ(kept.size(), 1u);
  EXPECT_EQ(kept[0].role, "system");
  EXPECT_EQ(*s.system_prompt(), "be brief");
}

TEST(ChatSession, SetMessagesTakesALeadingSystemMessage) {
  ChatSession s("alice", 0);
  s.set_messages({{"system", "sys"}, {"user", "u1"}, {"system", "late"}});
  EXPECT_EQ(*s.system_prompt(), "sys");
  EXPECT_EQ(s.messages().size(), 3u);
  EXPECT_THROW(s.set_messages({{"", "x"}}), c10::ValueError);
}

TEST(ChatSession, CommitThenPlanExtends) {
  ChatSession s("alice", 2);
  auto ids = iota_ids(10);
  s.commit(ids.data(), 10, attention_layers(2, 10), 0, kMarkers, kRule);
  auto prompt = iota_ids(15);
  auto plan = s.plan(prompt.data(), 15);
  EXPECT_EQ(plan.reason, ReuseReason::kExtend);
  auto layers = s.layers_for(plan);
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[0]->num_tokens(), 10);
  EXPECT_EQ(s.cache_info().cached_tokens, 10);
  EXPECT_EQ(s.cache_info().dtype, "Float");
}

TEST(ChatSession, CommitValidatesBeforeChangingAnything) {
  ChatSession s("alice", 2);
  auto ids = iota_ids(10);
  s.commit(ids.data(), 10, attention_layers(2, 10), 0, kMarkers, kRule);
  auto longer = iota_ids(12);
  // Wrong layer count, wrong token count, bad new_from: each rejected, cache unchanged.
  EXPECT_THROW(s.commit(longer.data(), 12, attention_layers(3, 12), 0, kMarkers, kRule),
               c10::ValueError);
  EXPECT_THROW(s.commit(longer.data(), 12, attention_layers(2, 11), 0, kMarkers, kRule),
               c10::ValueError);
  EXPECT_THROW(s.commit(longer.data(), 12, attention_layers(2, 12), 13, kMarkers, kRule),
               c10::IndexError);
  EXPECT_EQ(s.cache_info().cached_tokens, 10);
  EXPECT_EQ(s.cached_ids(), ids);
}

TEST(ChatSession, StalePlanIsRejected) {
  ChatSession s("alice", 1);
  auto ids = iota_ids(10);
  s.commit(ids.data(), 10, attention_layers(1, 10), 0, kMarkers, kRule);
  auto plan = s.plan(ids.data(), 10);
  s.invalidate_cache();
  EXPECT_THROW(s.layers_for(plan), c10::IndexError);
}

TEST(ChatSession, DegenerateReplyCapsTrustAtItsTurnBoundaryOnce) {
  ChatSession s("alice", 1);
  // Prompt of 10 ids ending in an end-of-turn (2), then a reply stuck in a loop.
  std::vector<int64_t> ids = iota_ids(9);
  ids.push_back(2);
  for (int i = 0; i < 70; ++i) ids.push_back(42);
  const auto n = static_cast<int64_t>(ids.size());
  s.commit(ids.data(), n, attention_layers(1, n), 10, kMarkers, kRule);
  EXPECT_EQ(s.cache_info().trusted_tokens, 10);
  EXPECT_NE(s.cache_info().last_check.find("repetition"), std::string::npos);

  std::vector<int64_t> next = ids;
  next.push_back(2);
  next.push_back(77);
  auto plan = s.plan(next.data(), static_cast<int64_t>(next.size()));
  EXPECT_EQ(plan.reason, ReuseReason::kInvalidated);
  EXPECT_EQ(plan.kept_tokens, 10);

  // The next commit re-checks only its new region: a clean one restores trust.
  std::vector<int64_t> clean = iota_ids(30);
  s.commit(clean.data(), 30, attention_layers(1, 30), 10, kMarkers, kRule);
  EXPECT_EQ(s.cache_info().trusted_tokens, 30);
  EXPECT_TRUE(s.cache_info().last_check.empty());
}

TEST(ChatSession, NonFiniteKvInTheNewRegionIsNotTrusted) {
  ChatSession s("alice", 1);
  auto ids = iota_ids(8);
  ids[3] = 2;  // a turn boundary at 4
  auto keys = at::zeros({1, 1, 8, 2});
  keys[0][0][6][0] = std::numeric_limits<float>::infinity();
  std::vector<LayerStatePtr> layers = {
      std::make_shared<AttentionState>(keys, at::zeros({1, 1, 8, 2}))};
  s.commit(ids.data(), 8, layers, 5, kMarkers, kRule);
  EXPECT_EQ(s.cache_info().trusted_tokens, 4);
}

TEST(ChatSession, HeldTokensStopWhereThePromptDepartsOrTrustEnds) {
  ChatSession s("alice", 1);
  const auto prompt = iota_ids(10);
  EXPECT_EQ(s.held_tokens(prompt.data(), 10), 0);  // nothing cached
  s.commit(prompt.data(), 8, attention_layers(1, 8), 0, kMarkers, kRule);
  EXPECT_EQ(s.held_tokens(prompt.data(), 10), 8);
  auto edited = prompt;
  edited[5] = 999;
  EXPECT_EQ(s.held_tokens(edited.data(), 10), 5);
  EXPECT_EQ(s.held_tokens(prompt.data(), 3), 3);
  s.invalidate_cache();
  EXPECT_EQ(s.held_tokens(prompt.data(), 10), 0);

  ChatSession capped("bob", 1);  // the non-finite case above: trusted up to 4
  auto ids = iota_ids(8);
  ids[3] = 2;
  auto keys = at::zeros({1, 1, 8, 2});
  keys[0][0][6][0] = std::numeric_limits<float>::infinity();
  capped.commit(ids.data(), 8, {std::make_shared<AttentionState>(keys, at::zeros({1, 1, 8, 2}))}, 5,
                kMarkers, kRule);
  EXPECT_EQ(capped.held_tokens(ids.data(), 8), 4);
}

TEST(ChatSession, ReleasedLayersLeaveCheckpointsThatStayEvictable) {
  ChatSession s("h", 2);
  auto ids = iota_ids(30);
  s.commit(ids.data(), 30, {testing::attention_layer(30), testing::recurrent_layer(30)}, 0,
           kMarkers, kRule, {{10, {nullptr, testing::recurrent_layer(10)}}});
  auto layers = s.layers_for(s.plan(ids.data(), 30));
  s.release_layers();
  EXPECT_TRUE(s.cached_ids().empty());
  EXPECT_EQ(s.cache_info().checkpoints, 1);
  // Whatever the budget counts must be evictable: checkpoints alone keep the
  // session resident, and a failed turn's invalidate_cache frees them.
  EXPECT_TRUE(s.resident());
  s.invalidate_cache();
  EXPECT_FALSE(s.resident());
  EXPECT_EQ(s.cache_info().nbytes, 0);
}

TEST(ChatSession, CommitGivesBackRoomLeftOverFromDecoding) {
  // A turn reserved room for 4096 tokens and used 42: the session keeps 42
  // (plus at most grown_capacity's headroom), not the reservation.
  ChatSession s("slack", 1);
  auto ids = iota_ids(42);
  auto buffer = KvBuffer::empty_like(at::zeros({1, 2, 1, 4}), at::zeros({1, 2, 1, 4}), 4096);
  buffer.append(at::ones({1, 2, 42, 4}), at::ones({1, 2, 42, 4}));
  s.commit(ids.data(), 42, {AttentionState::from_buffer(buffer)}, 0, kMarkers, kRule);
  const int64_t per_token = 2 * 2 * 4 * static_cast<int64_t>(sizeof(float));
  EXPECT_LE(s.cache_info().nbytes, KvBuffer::grown_capacity(42) * per_token);
  EXPECT_EQ(s.cache_info().cached_tokens, 42);

  // Room within grown_capacity is kept, so the next turn can append in place.
  ChatSession t("headroom", 1);
  auto kept = KvBuffer::empty_like(at::zeros({1, 2, 1, 4}), at::zeros({1, 2, 1, 4}), 50);
  kept.append(at::ones({1, 2, 42, 4}), at::ones({1, 2, 42, 4}));
  t.commit(ids.data(), 42, {AttentionState::from_buffer(kept)}, 0, kMarkers, kRule);
  EXPECT_EQ(t.cache_info().nbytes, 50 * per_token);
}

TEST(ChatSession, InvalidateKeepsMessagesAndCounters) {
  ChatSession s("alice", 1);
  s.add_message("user", "hi");
  auto ids = iota_ids(4);
  s.commit(ids.data(), 4, attention_layers(1, 4), 0, kMarkers, kRule, {}, "<s>hi");
  EXPECT_EQ(s.cached_text(), "<s>hi");
  TurnRecord turn;
  turn.prefilled_tokens = 4;
  s.record_turn(turn);
  s.invalidate_cache();
  EXPECT_FALSE(s.resident());
  EXPECT_EQ(s.cached_text(), "");  // text describes ids that are gone
  EXPECT_EQ(s.messages().size(), 1u);
  EXPECT_EQ(s.counters().prefilled_tokens, 4);
  EXPECT_EQ(s.cache_info().nbytes, 0);
}

}  // namespace
}  // namespace kvchat

namespace kvchat {
namespace {

std::vector<LayerStatePtr> hybrid_layers(int64_t tokens) {
  return {testing::attention_layer(tokens), testing::recurrent_layer(tokens)};
}

TEST(ChatSession, HybridRestoresACheckpointAndDropsStaleOnes) {
  ChatSession s("h", 2, CheckpointPolicy{8, 0});
  auto ids = testing::iota_ids(30);
  s.commit(ids.data(), 30, hybrid_layers(30), 0, kMarkers, kRule,
           {{10, {nullptr, testing::recurrent_layer(10)}},
            {25, {nullptr, testing::recurrent_layer(25)}}});
  auto prompt = testing::iota_ids(40);
  prompt[27] = 1;
  auto plan = s.plan(prompt.data(), 40);
  ASSERT_EQ(plan.kept_tokens, 25);
  auto layers = s.layers_for(plan);
  EXPECT_EQ(layers[0]->num_tokens(), 25);  // attention cropped
  EXPECT_EQ(layers[1]->num_tokens(), 25);  // recurrent from the checkpoint
  EXPECT_FLOAT_EQ(layers[1]->tensors()[0].view(-1)[0].item<float>(), 25.0f);

  // Next commit keeps 25 tokens: checkpoints beyond 25 would describe old ids.
  s.commit(prompt.data(), 40, hybrid_layers(40), 25, kMarkers, kRule,
           {{39, {nullptr, testing::recurrent_layer(39)}}});
  EXPECT_EQ(s.cache_info().checkpoint_positions, (std::vector<int64_t>{10, 25, 39}));
  EXPECT_GT(s.cache_info().checkpoint_bytes, 0);
}

TEST(ChatSession, HybridLayersRestoreThroughTheirSnapshots) {
  auto live = [](int64_t n) -> LayerStatePtr {
    return std::make_shared<HybridState>(testing::attention_layer(n), testing::recurrent_layer(n));
  };
  ChatSession s("falcon", 1);
  auto ids = testing::iota_ids(20);
  s.commit(ids.data(), 20, {live(20)}, 0, kMarkers, kRule, {{12, {live(12)->snapshot()}}});
  auto prompt = testing::iota_ids(30);
  prompt[15] = 1;
  auto plan = s.plan(prompt.data(), 30);
  ASSERT_EQ(plan.kept_tokens, 12);
  EXPECT_EQ(plan.checkpoint_position, 12);
  auto layer = std::static_pointer_cast<HybridState>(s.layers_for(plan)[0]);
  EXPECT_EQ(layer->attention()->num_tokens(), 12);
  EXPECT_FLOAT_EQ(layer->recurrent()->tensors()[0].view(-1)[0].item<float>(), 12.0f);
}

TEST(ChatSession, CheckpointMemoryStaysBoundedOverManyTurns) {
  const int64_t one = checkpoint_bytes({{1, {nullptr, testing::recurrent_layer(1)}}});
  ChatSession s("h", 2, CheckpointPolicy{4, one * 3});
  int64_t n = 0;
  for (int turn = 0; turn < 30; ++turn) {
    const int64_t kept = n;
    n += 10;
    auto ids = testing::iota_ids(n);
    s.commit(ids.data(), n, hybrid_layers(n), kept, kMarkers, kRule,
             {{n - 4, {nullptr, testing::recurrent_layer(n - 4)}},
              {n - 1, {nullptr, testing::recurrent_layer(n - 1)}}});
    EXPECT_LE(s.cache_info().checkpoints, 4);
    EXPECT_LE(s.cache_info().checkpoint_bytes, one * 3);
  }
  EXPECT_EQ(s.cache_info().checkpoint_positions.back(), n - 1);
  EXPECT_EQ(s.counters().checkpoints_taken, 60);
}

TEST(ChatSession, BadCheckpointsChangeNothing) {
  ChatSession s("h", 2);
  auto ids = testing::iota_ids(10);
  EXPECT_THROW(s.commit(ids.data(), 10, hybrid_layers(10), 0, kMarkers, kRule,
                        {{12, {nullptr, testing::recurrent_layer(12)}}}),
               c10::IndexError);
  EXPECT_FALSE(s.resident());
}

}  // namespace
}  // namespace kvchat
