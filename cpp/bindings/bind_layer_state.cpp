#include "bindings.h"
#include "kvchat/layer_state.h"

namespace kvchat {

void bind_layer_state(py::module_& m) {
  py::enum_<LayerKind>(m, "LayerKind")
      .value("attention", LayerKind::kAttention)
      .value("sliding_window", LayerKind::kSlidingWindow)
      .value("recurrent", LayerKind::kRecurrent)
      .value("hybrid", LayerKind::kHybrid);

  py::class_<LayerState, LayerStatePtr>(m, "LayerState")
      .def_property_readonly("kind", &LayerState::kind)
      .def_property_readonly("num_tokens", &LayerState::num_tokens)
      .def("can_crop_to", &LayerState::can_crop_to, py::arg("n"))
      .def("cropped", &LayerState::cropped, py::arg("n"))
      .def("snapshot", &LayerState::snapshot)
      .def(
          "can_restore",
          [](const LayerState& s, int64_t n, const LayerStatePtr& snapshot) {
            return s.can_restore(n, snapshot.get());
          },
          py::arg("n"), py::arg("snapshot") = nullptr)
      .def("restored", &LayerState::restored, py::arg("n"), py::arg("snapshot") = nullptr)
      .def("tensors", &LayerState::tensors)
      .def("nbytes", [](const LayerState& s) {
        StorageBytes seen;
        s.collect_storage(&seen);
        return total_bytes(seen);
      });

  py::class_<AttentionState, LayerState, std::shared_ptr<AttentionState>>(m, "AttentionState")
      .def(py::init<at::Tensor, at::Tensor>(), py::arg("keys"), py::arg("values"))
      .def_static("from_buffer", &AttentionState::from_buffer, py::arg("buffer"))
      .def("buffer", &AttentionState::buffer, py::arg("capacity") = 0)
      .def_property_readonly("prefix_tokens", &AttentionState::prefix_tokens)
      .def_property_readonly("keys", &AttentionState::keys)
      .def_property_readonly("values", &AttentionState::values);

  py::class_<SlidingWindowState, LayerState, std::shared_ptr<SlidingWindowState>>(
      m, "SlidingWindowState")
      .def(py::init<at::Tensor, at::Tensor, int64_t>(), py::arg("keys"), py::arg("values"),
           py::arg("total_tokens"))
      .def_property_readonly("held_tokens", &SlidingWindowState::held_tokens);

  py::class_<HybridState, LayerState, std::shared_ptr<HybridState>>(m, "HybridState")
      .def(py::init<LayerStatePtr, LayerStatePtr>(), py::arg("attention"), py::arg("recurrent"))
      .def_property_readonly("attention", &HybridState::attention)
      .def_property_readonly("recurrent", &HybridState::recurrent);

  py::class_<RecurrentState, LayerState, std::shared_ptr<RecurrentState>>(m, "RecurrentState")
      .def(py::init<std::vector<at::Tensor>, int64_t>(), py::arg("tensors"),
           py::arg("total_tokens"));
}

}  // namespace kvchat
