// Times the core's per-turn bookkeeping (begin_turn: plan, share lookup and
// layers; Turn::finish: checks, commit and record) for one session of 1k to 32k tokens,
// SmolLM2-135M-shaped: 30 layers, 3 KV heads of 64; then what prefix sharing adds to a turn through
// the manager (the share_prefix lookup, and the lease's reindex: the rebase and the radix-tree
// update). Runs outside the test suite: `make bench-overhead`.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <numeric>
#include <vector>

#include "kvchat/chat_session.h"
#include "kvchat/session_manager.h"

namespace {

constexpr int64_t kLayers = 30, kHeads = 3, kHeadDim = 64, kNewTokens = 200, kRepeats = 50;

std::vector<kvchat::LayerStatePtr> layers_of(int64_t tokens) {
  std::vector<kvchat::LayerStatePtr> layers;
  for (int64_t i = 0; i < kLayers; ++i) {
    auto kv = at::randn({1, kHeads, tokens, kHeadDim});
    layers.push_back(std::make_shared<kvchat::AttentionState>(kv, kv));
  }
  return layers;
}

double median_us(std::vector<double> samples) {
  std::sort(samples.begin(), samples.end());
  return samples[samples.size() / 2];
}

using clock_type = std::chrono::steady_clock;

double us_between(clock_type::time_point a, clock_type::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// What sharing adds to an ordinary turn of 200 new tokens, while another
// resident session holds the same ids: the share_prefix lookup (the session's
// own cache wins, so nothing is adopted) and the release's reindex (no rebase
// pays at these lengths, so it re-indexes the ids in the radix tree).
void sharing_overhead(const kvchat::TurnMarkers& markers, const kvchat::RepetitionRule& rule) {
  constexpr int64_t kPrefix = 1000;
  std::printf("\nwith sharing on: lookup and re-index per turn (message boundary at %lld)\n",
              static_cast<long long>(kPrefix));
  std::printf("%8s %12s %12s\n", "tokens", "share us", "reindex us");
  for (int64_t tokens : {1024, 4096, 8192, 16384, 32768}) {
    std::vector<int64_t> ids(tokens + kNewTokens);
    std::iota(ids.begin(), ids.end(), 10);
    ids[kPrefix - 1] = 2;  // the system prompt's end-of-turn: a message boundary
    auto cached = layers_of(tokens);
    auto grown = layers_of(tokens + kNewTokens);
    std::vector<double> share_us, reindex_us;
    for (int r = 0; r < kRepeats; ++r) {
      kvchat::ManagerLimits limits{4, 0, kLayers};
      limits.min_shared_tokens = 32;
      auto mgr =
          std::make_shared<kvchat::SessionManager>(limits, kvchat::TurnSettings{markers, rule});
      for (const std::string id : {"donor", "bench"}) {
        auto lease = mgr->acquire(id);
        lease->session()->commit(ids.data(), tokens, cached, 0, markers, rule);
      }
      auto lease = mgr->acquire("bench");
      auto& session = *lease->session();
      auto plan = session.plan(ids.data(), tokens + kNewTokens);  // timed in the table above
      auto t0 = clock_type::now();
      mgr->share_prefix(session, ids.data(), tokens + kNewTokens, plan);
      auto t1 = clock_type::now();
      session.commit(ids.data(), tokens + kNewTokens, grown, plan.kept_tokens, markers, rule);
      auto t2 = clock_type::now();
      lease->release();  // reindex: rebase when it pays, and re-index the ids
      auto t3 = clock_type::now();
      share_us.push_back(us_between(t0, t1));
      reindex_us.push_back(us_between(t2, t3));
    }
    std::printf("%8lld %12.1f %12.1f\n", static_cast<long long>(tokens), median_us(share_us),
                median_us(reindex_us));
  }
}

}  // namespace

int main() {
  const kvchat::TurnMarkers markers{{2}, {{1, 7, 5}}};
  const kvchat::RepetitionRule rule;
  std::printf("%8s %12s %12s %12s\n", "tokens", "begin us", "finish us", "total us");
  for (int64_t tokens : {1024, 4096, 8192, 16384, 32768}) {
    std::vector<int64_t> ids(tokens + kNewTokens);
    std::iota(ids.begin(), ids.end(), 10);
    auto cached = layers_of(tokens);
    auto grown = layers_of(tokens + kNewTokens);
    std::vector<double> begin_us, finish_us;
    for (int r = 0; r < kRepeats; ++r) {
      auto mgr = std::make_shared<kvchat::SessionManager>(kvchat::ManagerLimits{4, 0, kLayers},
                                                          kvchat::TurnSettings{markers, rule});
      auto lease = mgr->acquire("bench");
      auto& session = *lease->session();
      session.commit(ids.data(), tokens, cached, 0, markers, rule);
      // A turn of 200 new tokens: the prompt is the cached ids plus 199 more,
      // and the reply's first token completes the 200 the cache grows by.
      const int64_t prompt = tokens + kNewTokens - 1;
      auto t0 = clock_type::now();
      auto turn = mgr->begin_turn(*lease, ids.data(), prompt, 1);  // plan, share, layers
      auto t1 = clock_type::now();
      kvchat::TurnResult result;
      result.sequence.assign(ids.begin(), ids.end());
      result.sequence.push_back(3);
      result.cached_tokens = tokens + kNewTokens;
      result.layers = grown;
      auto t2 = clock_type::now();
      turn.finish(std::move(result));  // checks, commit, record
      auto t3 = clock_type::now();
      begin_us.push_back(us_between(t0, t1));
      finish_us.push_back(us_between(t2, t3));
    }
    const double b = median_us(begin_us), f = median_us(finish_us);
    std::printf("%8lld %12.1f %12.1f %12.1f\n", static_cast<long long>(tokens), b, f, b + f);
  }
  sharing_overhead(markers, rule);
  return 0;
}
