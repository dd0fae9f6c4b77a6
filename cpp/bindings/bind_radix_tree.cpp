#include "bindings.h"
#include "kvchat/radix_tree.h"

namespace kvchat {

void bind_radix_tree(py::module_& m) {
  // Exposed for property tests against a brute-force model.
  py::class_<TokenRadixTree>(m, "TokenRadixTree")
      .def(py::init<>())
      .def("insert", &TokenRadixTree::insert, py::arg("key"), py::arg("ids"))
      .def("erase", &TokenRadixTree::erase, py::arg("key"))
      .def("__contains__", &TokenRadixTree::contains, py::arg("key"))
      .def("__len__", &TokenRadixTree::size)
      .def(
          "longest_common_prefix",
          [](const TokenRadixTree& t, const std::vector<int64_t>& prompt) {
            const auto match = t.longest_common_prefix(prompt.data(), prompt.size());
            return py::make_tuple(match.length, match.key);
          },
          py::arg("prompt"))
      .def(
          "longest_stored_prefix",
          [](const TokenRadixTree& t, const std::vector<int64_t>& prompt) {
            const auto match = t.longest_stored_prefix(prompt.data(), prompt.size());
            return py::make_tuple(match.length, match.key);
          },
          py::arg("prompt"));
}

}  // namespace kvchat
