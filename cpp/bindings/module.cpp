#include <c10/util/Exception.h>

#include "bindings.h"
#include "kvchat/session_manager.h"

namespace kvchat {

std::pair<const int64_t*, int64_t> token_ids_view(const at::Tensor& ids, const char* name) {
  TORCH_CHECK_VALUE(ids.dim() == 1, name, " must be a 1-D tensor of token ids, got shape ",
                    ids.sizes());
  TORCH_CHECK_VALUE(ids.scalar_type() == at::kLong, name, " must be int64, got ",
                    ids.scalar_type());
  TORCH_CHECK_VALUE(ids.device().is_cpu(), name, " must be on the CPU, got ", ids.device());
  TORCH_CHECK_VALUE(ids.is_contiguous(), name, " must be contiguous");
  return {ids.data_ptr<int64_t>(), ids.numel()};
}

}  // namespace kvchat

PYBIND11_MODULE(_C, m) {
  namespace py = pybind11;
  m.doc() = "kvchat core: sessions, reuse planning and checks over libtorch tensors";
  m.attr("__torch_version__") = KVCHAT_TORCH_VERSION;

  // Python sees ValueError/IndexError/TypeError without the C++ backtrace.
  static py::exception<kvchat::UnknownSessionError> unknown_session(m, "UnknownSessionError",
                                                                    PyExc_KeyError);
  static py::exception<kvchat::SessionBusyError> session_busy(m, "SessionBusy", PyExc_RuntimeError);
  py::register_local_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const kvchat::UnknownSessionError& e) {
      py::set_error(unknown_session, e.what());
    } catch (const kvchat::SessionBusyError& e) {
      py::set_error(session_busy, e.what());
    } catch (const c10::ValueError& e) {
      py::set_error(PyExc_ValueError, e.what_without_backtrace());
    } catch (const c10::IndexError& e) {
      py::set_error(PyExc_IndexError, e.what_without_backtrace());
    } catch (const c10::TypeError& e) {
      py::set_error(PyExc_TypeError, e.what_without_backtrace());
    } catch (const c10::Error& e) {
      py::set_error(PyExc_RuntimeError, e.what_without_backtrace());
    }
  });

  kvchat::bind_kv_buffer(m);
  kvchat::bind_layer_state(m);
  kvchat::bind_prefix(m);
  kvchat::bind_radix_tree(m);
  kvchat::bind_turn_checks(m);
  kvchat::bind_chat_session(m);
  kvchat::bind_session_manager(m);
  kvchat::bind_turn(m);
}
