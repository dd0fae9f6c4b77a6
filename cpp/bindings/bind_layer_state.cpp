#include "bindings.h"
#include "kvchat/layer_state.h"

namespace kvchat {

namespace {

// LayerMeta as a plain dict, so it can be stored as JSON:
// {"kind": "hybrid", "tokens": 9, "tensors": 4, "parts": [...]}.
py::dict meta_to_dict(const LayerMeta& meta) {
  py::dict out;
  out["kind"] = to_string(meta.kind);
  out["tokens"] = meta.tokens;
  out["tensors"] = meta.tensors;
  py::list parts;
  for (const auto& part : meta.parts) parts.append(meta_to_dict(part));
  out["parts"] = parts;
  return out;
}

int64_t count_field(const py::dict& d, const char* key) {
  TORCH_CHECK_VALUE(d.contains(key), "layer meta has no '", key, "'");
  py::object value = d[key];
  TORCH_CHECK_VALUE(py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value),
                    "layer meta '", key, "' must be an int, got ",
                    py::str(value).cast<std::string>());
  return value.cast<int64_t>();
}

LayerMeta meta_from_dict(const py::handle& handle) {
  TORCH_CHECK_VALUE(py::isinstance<py::dict>(handle), "layer meta must be a dict, got ",
                    py::str(handle.get_type()).cast<std::string>());
  const auto d = py::reinterpret_borrow<py::dict>(handle);
  TORCH_CHECK_VALUE(d.contains("kind") && py::isinstance<py::str>(d["kind"]),
                    "layer meta needs a 'kind' string");
  const auto kind = d["kind"].cast<std::string>();
  LayerMeta meta;
  bool known = false;
  for (auto k : {LayerKind::kAttention, LayerKind::kSlidingWindow, LayerKind::kRecurrent,
                 LayerKind::kHybrid}) {
    if (to_string(k) == kind) meta.kind = k, known = true;
  }
  TORCH_CHECK_VALUE(known, "layer meta has an unknown kind '", kind, "'");
  meta.tokens = count_field(d, "tokens");
  meta.tensors = count_field(d, "tensors");
  if (d.contains("parts")) {
    TORCH_CHECK_VALUE(py::isinstance<py::list>(d["parts"]), "layer meta 'parts' must be a list");
    for (const auto& part : d["parts"].cast<py::list>()) meta.parts.push_back(meta_from_dict(part));
  }
  return meta;
}

}  // namespace

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
      // Self-description: state.meta and state.tensors() rebuild it via from_state.
      .def_property_readonly("meta", [](const LayerState& s) { return meta_to_dict(s.meta()); })
      .def("parts", &LayerState::parts)
      .def_static(
          "from_state",
          [](const py::handle& meta, std::vector<at::Tensor> tensors) {
            return layer_state_from(meta_from_dict(meta), std::move(tensors));
          },
          py::arg("meta"), py::arg("tensors"))
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
