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

// Attention-only plans, one a row: the cache (`cached` ids, trusted up to
// `trusted`), the prompt (`prompt` ids, one edited at `edit` unless -1), and
// what the plan keeps and why.
struct PlanCase {
  const char* what;
  int64_t cached, trusted, prompt, edit;
  ReuseReason reason;
  int64_t kept;
};

TEST(PlanReuse, KeepsWhatTheCacheSharesWithThePrompt) {
  const PlanCase cases[] = {
      {"nothing cached", 0, 0, 5, -1, ReuseReason::kNoCache, 0},
      {"an extension keeps the whole cache", 6, 6, 10, -1, ReuseReason::kExtend, 6},
      // The cache holds the prompt plus a reply; the same prompt comes again.
      {"a regenerate keeps all but the last prompt token", 12, 12, 8, -1,
       ReuseReason::kPromptCached, 7},
      {"an identical prompt still runs its last token", 8, 8, 8, -1, ReuseReason::kPromptCached, 7},
      {"an edited earlier message keeps up to the divergence", 10, 10, 12, 4,
       ReuseReason::kDiverged, 4},
      {"the trust cap invalidates the rest", 10, 6, 14, -1, ReuseReason::kInvalidated, 6},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.what);
    const auto cached = iota_ids(c.cached);
    auto prompt = iota_ids(c.prompt);
    if (c.edit >= 0) prompt[c.edit] = 7;
    const auto layers = c.cached > 0 ? attention_layers(2, c.cached) : std::vector<LayerStatePtr>{};
    const auto plan = plan_reuse(cached, prompt.data(), c.prompt, c.trusted, layers);
    EXPECT_EQ(plan.reason, c.reason);
    EXPECT_EQ(plan.kept_tokens, c.kept);
    EXPECT_EQ(plan.new_tokens(), c.prompt - c.kept);
    if (c.edit >= 0) EXPECT_EQ(plan.common_prefix, c.edit);
    if (c.reason == ReuseReason::kInvalidated) {
      EXPECT_NE(plan.detail.find("checks trust"), std::string::npos) << plan.detail;
    }
  }
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
