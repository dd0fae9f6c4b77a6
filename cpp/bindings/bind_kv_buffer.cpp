#include "bindings.h"
#include "kvchat/kv_buffer.h"

namespace kvchat {

void bind_kv_buffer(py::module_& m) {
  // Called once per layer per decoded token, so no GIL release: the copies
  // are small and releasing would cost more than it saves.
  py::class_<KvBuffer>(m, "KvBuffer")
      .def(py::init<const at::Tensor&, const at::Tensor&>(), py::arg("keys"), py::arg("values"))
      .def_static("empty_like", &KvBuffer::empty_like, py::arg("keys"), py::arg("values"),
                  py::arg("capacity"))
      .def_static("grown_capacity", &KvBuffer::grown_capacity, py::arg("needed"))
      .def("reserve", &KvBuffer::reserve, py::arg("total_tokens"))
      .def("append", &KvBuffer::append, py::arg("keys"), py::arg("values"))
      .def("crop", &KvBuffer::crop, py::arg("length"))
      .def_property_readonly("length", &KvBuffer::length)
      .def_property_readonly("capacity", &KvBuffer::capacity)
      .def_property_readonly("reallocations", &KvBuffer::reallocations)
      .def("keys", &KvBuffer::keys)
      .def("values", &KvBuffer::values);
}

}  // namespace kvchat
