#include "bindings.h"
#include "kvchat/session_manager.h"

namespace kvchat {

void bind_session_manager(py::module_& m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;

  py::class_<ManagerStats>(m, "ManagerStats")
      .def_readonly("totals", &ManagerStats::totals)
      .def_readonly("evictions", &ManagerStats::evictions)
      .def_readonly("resident_bytes", &ManagerStats::resident_bytes)
      .def_readonly("checkpoint_bytes", &ManagerStats::checkpoint_bytes)
      .def_readonly("reserved_bytes", &ManagerStats::reserved_bytes)
      .def_readonly("sessions", &ManagerStats::sessions)
      .def_readonly("resident_sessions", &ManagerStats::resident_sessions)
      .def_readonly("shared_prefixes", &ManagerStats::shared_prefixes)
      .def_readonly("prefix_shares", &ManagerStats::prefix_shares)
      .def_readonly("shared_tokens", &ManagerStats::shared_tokens)
      .def_property_readonly("hit_rate", &ManagerStats::hit_rate);

  // A context manager: `with manager.acquire(id) as session: ...`
  py::class_<SessionLease>(m, "SessionLease")
      .def_property_readonly("session", &SessionLease::session)
      .def("release", &SessionLease::release, no_gil())
      .def_property_readonly("active", &SessionLease::active)
      .def("__enter__", &SessionLease::session)
      .def("__exit__", [](SessionLease& lease, const py::args&) {
        py::gil_scoped_release release;
        lease.release();
      });

  // The core's two option objects, built once by the Python manager
  // (arguments.ManagerOptions) and checked by SessionManager's constructor.
  py::class_<CheckpointPolicy>(m, "CheckpointPolicy")
      .def(py::init([](int64_t max_count, int64_t max_bytes) {
             return CheckpointPolicy{max_count, max_bytes};
           }),
           py::arg("max_count") = 8, py::arg("max_bytes") = 0)
      .def_readonly("max_count", &CheckpointPolicy::max_count)
      .def_readonly("max_bytes", &CheckpointPolicy::max_bytes);

  py::class_<ManagerLimits>(m, "ManagerLimits")
      .def(py::init([](int64_t max_sessions, int64_t max_cache_bytes, int64_t num_layers,
                       CheckpointPolicy checkpoints, int64_t min_shared_tokens, bool keep_evicted,
                       bool isolate_namespaces) {
             return ManagerLimits{max_sessions,      max_cache_bytes,   num_layers,
                                  checkpoints,       min_shared_tokens, keep_evicted,
                                  isolate_namespaces};
           }),
           py::kw_only(), py::arg("max_sessions") = 16, py::arg("max_cache_bytes") = 0,
           py::arg("num_layers") = 0, py::arg("checkpoints") = CheckpointPolicy{},
           py::arg("min_shared_tokens") = 0, py::arg("keep_evicted") = false,
           py::arg("isolate_namespaces") = false)
      .def_readonly("max_sessions", &ManagerLimits::max_sessions)
      .def_readonly("max_cache_bytes", &ManagerLimits::max_cache_bytes)
      .def_readonly("num_layers", &ManagerLimits::num_layers)
      .def_readonly("checkpoints", &ManagerLimits::checkpoints)
      .def_readonly("min_shared_tokens", &ManagerLimits::min_shared_tokens)
      .def_readonly("keep_evicted", &ManagerLimits::keep_evicted)
      .def_readonly("isolate_namespaces", &ManagerLimits::isolate_namespaces);

  py::class_<TurnSettings>(m, "TurnSettings")
      .def(py::init([](TurnMarkers markers, RepetitionRule repetition, bool prefill_checkpoints,
                       CheckpointPlacement placement) {
             return TurnSettings{std::move(markers), repetition, prefill_checkpoints, placement};
           }),
           py::kw_only(), py::arg("markers") = TurnMarkers{},
           py::arg("repetition") = RepetitionRule{}, py::arg("prefill_checkpoints") = false,
           py::arg("placement") = CheckpointPlacement::kLastMessage)
      .def_readonly("markers", &TurnSettings::markers)
      .def_readonly("repetition", &TurnSettings::repetition)
      .def_readonly("prefill_checkpoints", &TurnSettings::prefill_checkpoints)
      .def_readonly("placement", &TurnSettings::placement);

  // As for ChatSession: every method that takes a lock releases the GIL first.
  py::class_<SessionManager, std::shared_ptr<SessionManager>>(m, "SessionManager")
      .def(py::init([](ManagerLimits limits, TurnSettings settings) {
             return std::make_shared<SessionManager>(limits, std::move(settings));
           }),
           py::arg("limits") = ManagerLimits{}, py::arg("settings") = TurnSettings{})
      .def("take_evicted",
           [](SessionManager& m) {
             std::vector<EvictedCache> evicted;
             {
               py::gil_scoped_release release;  // see ChatSession: never wait on a lock with it
               evicted = m.take_evicted();
             }
             std::vector<std::pair<std::string, CachedState>> out;
             for (auto& e : evicted) out.emplace_back(e.id, std::move(e.state));
             return out;
           })
      .def("acquire", &SessionManager::acquire, py::arg("session_id"), py::arg("wait") = true,
           py::arg("create") = true, py::arg("touch") = true, no_gil())
      .def("find", &SessionManager::find, py::arg("session_id"), no_gil())
      .def("__contains__", &SessionManager::contains, py::arg("session_id"), no_gil())
      .def("session_ids", &SessionManager::session_ids, no_gil())
      .def("clear", &SessionManager::clear, py::arg("session_id"), no_gil())
      .def("remove", &SessionManager::remove, py::arg("session_id"), no_gil())
      .def("stats", &SessionManager::stats, no_gil())
      // Evicts under the manager's lock: the GIL is released first.
      .def("set_reserved_bytes", &SessionManager::set_reserved_bytes, py::arg("bytes"), no_gil())
      .def_property_readonly("reserved_bytes",
                             py::cpp_function(&SessionManager::reserved_bytes, no_gil()))
      .def_property_readonly("max_sessions",
                             [](const SessionManager& s) { return s.limits().max_sessions; })
      .def_property_readonly("max_cache_bytes",
                             [](const SessionManager& s) { return s.limits().max_cache_bytes; });
}

}  // namespace kvchat
