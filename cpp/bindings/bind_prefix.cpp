#include "bindings.h"
#include "kvchat/prefix.h"

namespace kvchat {

void bind_prefix(py::module_& m) {
  py::enum_<ReuseReason>(m, "ReuseReason")
      .value("no_cache", ReuseReason::kNoCache)
      .value("extend", ReuseReason::kExtend)
      .value("prompt_cached", ReuseReason::kPromptCached)
      .value("diverged", ReuseReason::kDiverged)
      .value("invalidated", ReuseReason::kInvalidated)
      .value("shared_prefix", ReuseReason::kSharedPrefix)
      .value("spill_reload", ReuseReason::kTierReload)
      .value("store_reload", ReuseReason::kStoreReload)
      .value("unsupported_layers", ReuseReason::kUnsupportedLayers)
      .value("multiple_sequences", ReuseReason::kMultipleSequences)
      .value("unsupported_generation", ReuseReason::kUnsupportedGeneration);

  py::class_<ReusePlan>(m, "ReusePlan")
      .def_readonly("cached_tokens", &ReusePlan::cached_tokens)
      .def_readonly("prompt_tokens", &ReusePlan::prompt_tokens)
      .def_readonly("common_prefix", &ReusePlan::common_prefix)
      .def_readonly("kept_tokens", &ReusePlan::kept_tokens)
      .def_readonly("checkpoint_position", &ReusePlan::checkpoint_position)
      .def_readonly("reason", &ReusePlan::reason)
      .def_readonly("detail", &ReusePlan::detail)
      .def_property_readonly("new_tokens", &ReusePlan::new_tokens)
      .def("__repr__", [](const ReusePlan& p) {
        return "ReusePlan(" + to_string(p.reason) + ": " + p.detail + ")";
      });

  m.def(
      "common_prefix_length",
      [](const at::Tensor& a, const at::Tensor& b) {
        auto [pa, na] = token_ids_view(a, "a");
        auto [pb, nb] = token_ids_view(b, "b");
        py::gil_scoped_release no_gil;
        return common_prefix_length(pa, na, pb, nb);
      },
      py::arg("a"), py::arg("b"));
}

}  // namespace kvchat
