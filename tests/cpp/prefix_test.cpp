#include "kvchat/prefix.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "test_util.h"

namespace kvchat {
namespace {

using testing::attention_layers;
using testing::iota_ids;

TEST(CommonPrefixLength, CountsUpToTheFirstDifference) {
  std::vector<int64_t> a = {1, 2, 3, 4}, b = {1, 2, 9, 4}, c = {1, 2};
  EXPECT_EQ(common_prefix_length(a.data(), 4, b.data(), 4), 2);
  EXPECT_EQ(common_prefix_length(a.data(), 4, a.data(), 4), 4);
  EXPECT_EQ(common_prefix_length(a.data(), 4, c.data(), 2), 2);
  EXPECT_EQ(common_prefix_length(a.data(), 0, c.data(), 2), 0);
}

TEST(PlanReuse, NoCache) {
  auto prompt = iota_ids(5);
  auto plan = plan_reuse({}, prompt.data(), 5, 0, {});
  EXPECT_EQ(plan.reason, ReuseReason::kNoCache);
  EXPECT_EQ(plan.kept_tokens, 0);
  EXPECT_EQ(plan.new_tokens(), 5);
}

TEST(PlanReuse, ExtendKeepsTheWholeCache) {
  auto cached = iota_ids(6);
  auto prompt = iota_ids(10);
  auto plan = plan_reuse(cached, prompt.data(), 10, 6, attention_layers(2, 6));
  EXPECT_EQ(plan.reason, ReuseReason::kExtend);
  EXPECT_EQ(plan.kept_tokens, 6);
  EXPECT_EQ(plan.new_tokens(), 4);
}

TEST(PlanReuse, RegenerateKeepsAllButTheLastPromptToken) {
  // The cache holds the prompt plus a reply; the same prompt comes again.
  auto cached = iota_ids(12);
  auto prompt = iota_ids(8);
  auto plan = plan_reuse(cached, prompt.data(), 8, 12, attention_layers(2, 12));
  EXPECT_EQ(plan.reason, ReuseReason::kPromptCached);
  EXPECT_EQ(plan.kept_tokens, 7);
  EXPECT_EQ(plan.new_tokens(), 1);
}

TEST(PlanReuse, IdenticalPromptStillRunsItsLastToken) {
  auto ids = iota_ids(8);
  auto plan = plan_reuse(ids, ids.data(), 8, 8, attention_layers(1, 8));
  EXPECT_EQ(plan.kept_tokens, 7);
  EXPECT_EQ(plan.reason, ReuseReason::kPromptCached);
}

TEST(PlanReuse, DivergedKeepsUpToTheLcp) {
  auto cached = iota_ids(10);
  auto prompt = iota_ids(12);
  prompt[4] = 7;  // an edited earlier message
  auto plan = plan_reuse(cached, prompt.data(), 12, 10, attention_layers(2, 10));
  EXPECT_EQ(plan.reason, ReuseReason::kDiverged);
  EXPECT_EQ(plan.common_prefix, 4);
  EXPECT_EQ(plan.kept_tokens, 4);
}

TEST(PlanReuse, TrustCapInvalidates) {
  auto cached = iota_ids(10);
  auto prompt = iota_ids(14);
  auto plan = plan_reuse(cached, prompt.data(), 14, 6, attention_layers(2, 10));
  EXPECT_EQ(plan.reason, ReuseReason::kInvalidated);
  EXPECT_EQ(plan.kept_tokens, 6);
  EXPECT_NE(plan.detail.find("checks trust"), std::string::npos);
}

TEST(PlanReuse, KeptIsAlwaysShorterThanThePrompt) {
  for (int64_t cached_len = 1; cached_len < 12; ++cached_len) {
    for (int64_t prompt_len = 1; prompt_len < 12; ++prompt_len) {
      auto cached = iota_ids(cached_len);
      auto prompt = iota_ids(prompt_len);
      auto plan = plan_reuse(cached, prompt.data(), prompt_len, cached_len,
                             attention_layers(1, cached_len));
      EXPECT_LT(plan.kept_tokens, prompt_len);
      EXPECT_LE(plan.kept_tokens, cached_len);
    }
  }
}

TEST(PlanReuse, EmptyPromptIsAValueError) {
  EXPECT_THROW(plan_reuse(iota_ids(3), nullptr, 0, 3, attention_layers(1, 3)), c10::ValueError);
}

}  // namespace
}  // namespace kvchat

namespace kvchat {
namespace {

TEST(PlanReuse, HybridRestoresTheLatestCheckpointAtOrBeforeTheLcp) {
  std::vector<LayerStatePtr> layers = {testing::attention_layer(20), testing::recurrent_layer(20)};
  std::vector<Checkpoint> checkpoints = {{5, {nullptr, testing::recurrent_layer(5)}},
                                         {12, {nullptr, testing::recurrent_layer(12)}}};
  auto cached = testing::iota_ids(20);
  auto prompt = testing::iota_ids(30);
  prompt[15] = 1;  // diverges inside the last reply
  auto plan = plan_reuse(cached, prompt.data(), 30, 20, layers, checkpoints);
  EXPECT_EQ(plan.kept_tokens, 12);
  EXPECT_EQ(plan.checkpoint_position, 12);
  EXPECT_EQ(plan.reason, ReuseReason::kDiverged);

  // Extending the whole cache needs no checkpoint: the live state is at 20.
  auto extend = plan_reuse(cached, testing::iota_ids(30).data(), 30, 20, layers, checkpoints);
  EXPECT_EQ(extend.kept_tokens, 20);
  EXPECT_EQ(extend.checkpoint_position, -1);
  EXPECT_EQ(extend.reason, ReuseReason::kExtend);
}

TEST(PlanReuse, HybridWithoutAUsableCheckpointStartsOver) {
  std::vector<LayerStatePtr> layers = {testing::attention_layer(20), testing::recurrent_layer(20)};
  auto cached = testing::iota_ids(20);
  auto prompt = testing::iota_ids(20);  // a regenerate: needs the state at 19
  auto plan = plan_reuse(cached, prompt.data(), 20, 20, layers, {});
  EXPECT_EQ(plan.kept_tokens, 0);
  EXPECT_EQ(plan.reason, ReuseReason::kInvalidated);
  std::vector<Checkpoint> at_19 = {{19, {nullptr, testing::recurrent_layer(19)}}};
  EXPECT_EQ(plan_reuse(cached, prompt.data(), 20, 20, layers, at_19).kept_tokens, 19);
}

}  // namespace
}  // namespace kvchat
