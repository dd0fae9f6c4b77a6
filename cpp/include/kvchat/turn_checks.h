// Turn-boundary and corruption checks on token ids. Markers come from the
// tokenizer (end-of-turn ids, role-header sequences), never English strings.
// Checks look only at a region that is new this turn, so one odd message
// cannot poison every later turn.
#pragma once

#include <cstdint>
#include <vector>

namespace kvchat {

struct TurnMarkers {
  std::vector<int64_t> end_of_turn_ids;            // e.g. <|im_end|>, eos
  std::vector<std::vector<int64_t>> role_headers;  // e.g. "<|im_start|>assistant\n" as ids
};

// Validates markers: no empty role header, no negative ids. Throws ValueError.
void check_markers(const TurnMarkers& markers);

// Positions in [begin, end] that sit on a turn boundary: just after an
// end-of-turn id, or at the start of a role header. Sorted, unique.
std::vector<int64_t> find_turn_boundaries(const int64_t* ids, int64_t n, int64_t begin, int64_t end,
                                          const TurnMarkers& markers);

// The last boundary at or before `pos` (0 when there is none).
int64_t last_turn_boundary(const int64_t* ids, int64_t n, int64_t pos, const TurnMarkers& markers);

struct RepetitionRule {
  int64_t max_period = 8;       // loops of 1..max_period tokens
  int64_t min_run_tokens = 64;  // how long the loop must run to count as degenerate
};

// If ids[begin:end) ends in a loop (a block of <= max_period tokens repeated
// until it spans at least min_run_tokens, all inside the region), the position
// where that loop starts; otherwise -1.
int64_t find_repetition_loop(const int64_t* ids, int64_t begin, int64_t end,
                             const RepetitionRule& rule);

}  // namespace kvchat
