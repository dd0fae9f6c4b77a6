#include "bindings.h"
#include "kvchat/turn_checks.h"

namespace kvchat {

void bind_turn_checks(py::module_& m) {
  py::class_<TurnMarkers>(m, "TurnMarkers")
      .def(py::init([](std::vector<int64_t> end_of_turn_ids,
                       std::vector<std::vector<int64_t>> role_headers) {
             TurnMarkers markers{std::move(end_of_turn_ids), std::move(role_headers)};
             check_markers(markers);
             return markers;
           }),
           py::arg("end_of_turn_ids"), py::arg("role_headers"))
      .def_readonly("end_of_turn_ids", &TurnMarkers::end_of_turn_ids)
      .def_readonly("role_headers", &TurnMarkers::role_headers);

  py::class_<RepetitionRule>(m, "RepetitionRule")
      .def(py::init([](int64_t max_period, int64_t min_run_tokens) {
             return RepetitionRule{max_period, min_run_tokens};
           }),
           py::arg("max_period") = 8, py::arg("min_run_tokens") = 64)
      .def_readonly("max_period", &RepetitionRule::max_period)
      .def_readonly("min_run_tokens", &RepetitionRule::min_run_tokens);

  m.def(
      "find_turn_boundaries",
      [](const at::Tensor& ids, const TurnMarkers& markers) {
        auto [data, n] = token_ids_view(ids, "token_ids");
        py::gil_scoped_release no_gil;
        return find_turn_boundaries(data, n, 0, n, markers);
      },
      py::arg("token_ids"), py::arg("markers"));

  m.def(
      "find_repetition_loop",
      [](const at::Tensor& ids, int64_t begin, const RepetitionRule& rule) {
        auto [data, n] = token_ids_view(ids, "token_ids");
        TORCH_CHECK_INDEX(begin >= 0 && begin <= n, "begin must be in [0, ", n, "], got ", begin);
        return find_repetition_loop(data, begin, n, rule);
      },
      py::arg("token_ids"), py::arg("begin") = 0, py::arg("rule") = RepetitionRule{});
}

}  // namespace kvchat
