// Binding entry points, one per concept; module.cpp only wires them.
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <utility>

namespace kvchat {

namespace py = pybind11;

void bind_kv_buffer(py::module_& m);
void bind_layer_state(py::module_& m);
void bind_prefix(py::module_& m);
void bind_radix_tree(py::module_& m);
void bind_turn_checks(py::module_& m);
void bind_chat_session(py::module_& m);
void bind_session_manager(py::module_& m);
void bind_turn(py::module_& m);  // after bind_session_manager: it adds methods

// A 1-D int64 CPU contiguous tensor of token ids, as (data, length), so ids
// cross the boundary without a copy. `name` is the argument the user passed.
std::pair<const int64_t*, int64_t> token_ids_view(const at::Tensor& ids, const char* name);

}  // namespace kvchat
