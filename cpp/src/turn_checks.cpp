#include "kvchat/turn_checks.h"

#include <c10/util/Exception.h>

#include <algorithm>

namespace kvchat {

void check_markers(const TurnMarkers& markers) {
  for (int64_t id : markers.end_of_turn_ids) {
    TORCH_CHECK_VALUE(id >= 0, "end_of_turn_ids must be token ids >= 0, got ", id);
  }
  for (size_t i = 0; i < markers.role_headers.size(); ++i) {
    TORCH_CHECK_VALUE(!markers.role_headers[i].empty(), "role_headers[", i, "] is empty");
  }
}

namespace {

bool header_starts_at(const int64_t* ids, int64_t n, int64_t pos,
                      const std::vector<int64_t>& header) {
  const auto len = static_cast<int64_t>(header.size());
  return pos + len <= n && std::equal(header.begin(), header.end(), ids + pos);
}

bool is_boundary(const int64_t* ids, int64_t n, int64_t pos, const TurnMarkers& markers) {
  if (pos > 0) {
    const int64_t prev = ids[pos - 1];
    for (int64_t eot : markers.end_of_turn_ids) {
      if (prev == eot) return true;
    }
  }
  for (const auto& header : markers.role_headers) {
    if (header_starts_at(ids, n, pos, header)) return true;
  }
  return false;
}

}  // namespace

std::vector<int64_t> find_turn_boundaries(const int64_t* ids, int64_t n, int64_t begin, int64_t end,
                                          const TurnMarkers& markers) {
  TORCH_CHECK_INDEX(begin >= 0 && begin <= end && end <= n, "boundary range [", begin, ", ", end,
                    "] is outside the ", n, " token ids");
  std::vector<int64_t> found;
  for (int64_t pos = begin; pos <= end; ++pos) {
    if (is_boundary(ids, n, pos, markers)) found.push_back(pos);
  }
  return found;
}

int64_t last_turn_boundary(const int64_t* ids, int64_t n, int64_t pos, const TurnMarkers& markers) {
  TORCH_CHECK_INDEX(pos >= 0 && pos <= n, "position ", pos, " is outside the ", n, " token ids");
  for (int64_t p = pos; p > 0; --p) {
    if (is_boundary(ids, n, p, markers)) return p;
  }
  return 0;
}

int64_t find_repetition_loop(const int64_t* ids, int64_t begin, int64_t end,
                             const RepetitionRule& rule) {
  TORCH_CHECK_VALUE(rule.max_period >= 1, "max_period must be >= 1, got ", rule.max_period);
  TORCH_CHECK_VALUE(rule.min_run_tokens >= 2, "min_run_tokens must be >= 2, got ",
                    rule.min_run_tokens);
  if (end - begin < rule.min_run_tokens) return -1;
  int64_t best_start = -1;
  for (int64_t period = 1; period <= rule.max_period; ++period) {
    // Walk back from the tail while each token equals the one a period later.
    int64_t start = end - period;
    while (start - 1 >= begin && ids[start - 1] == ids[start - 1 + period]) --start;
    const int64_t run = end - start;
    const bool repeats = run >= 2 * period;
    if (repeats && run >= rule.min_run_tokens && (best_start < 0 || start < best_start)) {
      best_start = start;
    }
  }
  return best_start;
}

}  // namespace kvchat
