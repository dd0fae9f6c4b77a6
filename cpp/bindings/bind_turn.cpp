#include "bindings.h"
#include "kvchat/session_manager.h"
#include "kvchat/turn.h"

namespace kvchat {

namespace {

// What a Python Turn is held by. An unfinished Turn is aborted when it dies,
// and a Python one dies where the interpreter decides (a dropped reference,
// a garbage collection, on any thread, possibly one holding a lease): always
// with the GIL held. The abort takes the session's lock, and the rule is
// never to wait on a core lock holding the GIL, so the GIL is released around
// it (a thread holding that lock never waits for the GIL, as no tensor dies
// under it, but the rule does not lean on that). The abort never takes a turn
// lock, so a collection on a thread that holds this session's lease cannot
// deadlock on it, and it drops the session's cache only if it is still what
// this turn left (see Turn::abort), so a turn collected after its lease was
// let go cannot drop a later turn's cache. What it drops dies after the
// session's lock, without the GIL (a tensor with a Python object takes it
// itself, as in every binding that releases it). The plan's layers die with
// the Turn, after the GIL is taken back, under no core lock.
struct AbortWithoutGil {
  void operator()(Turn* turn) const noexcept {
    // Held unless a C++ caller dropped the holder without it. Kept while the
    // interpreter shuts down: no other thread runs Python then, and a thread
    // that lets the GIL go then may be stopped before it gets it back.
#if PY_VERSION_HEX >= 0x030D0000
    const bool finalizing = Py_IsFinalizing();
#else
    const bool finalizing = _Py_IsFinalizing();
#endif
    if (PyGILState_Check() && !finalizing) {
      py::gil_scoped_release release;
      turn->abort();
    }
    delete turn;  // aborts here, if it did not above
  }
};
using TurnHolder = std::unique_ptr<Turn, AbortWithoutGil>;

}  // namespace

void bind_turn(py::module_& m) {
  py::class_<TurnPlan>(m, "TurnPlan")
      .def_property_readonly("prompt_tokens", &TurnPlan::prompt_tokens)
      .def_readonly("kept_tokens", &TurnPlan::kept_tokens)
      .def_readonly("checkpoint_restored", &TurnPlan::checkpoint_restored)
      .def_readonly("reserve", &TurnPlan::reserve)
      .def_readonly("reason", &TurnPlan::reason)
      .def_readonly("plain", &TurnPlan::plain)
      .def_readonly("detail", &TurnPlan::detail)
      .def_readonly("reload_error", &TurnPlan::reload_error)
      .def_readonly("checkpoint_positions", &TurnPlan::checkpoint_positions)
      .def_readonly("snapshot_prompt_end", &TurnPlan::snapshot_prompt_end)
      .def_readonly("checkpoints", &TurnPlan::checkpoints)
      .def("take_layers", &TurnPlan::take_layers)
      .def("__repr__", [](const TurnPlan& p) {
        return "TurnPlan(" + to_string(p.reason) + ", keeps " + std::to_string(p.kept_tokens) +
               " of " + std::to_string(p.prompt_tokens()) + ")";
      });

  // Consumed by Turn.finish: its layers and checkpoints move into the session.
  py::class_<TurnResult>(m, "TurnResult")
      .def(py::init([](const at::Tensor& sequence, std::vector<LayerStatePtr> layers,
                       int64_t cached_tokens, std::vector<Checkpoint> checkpoints, std::string text,
                       std::optional<std::vector<Message>> messages, double prefill_ms,
                       double total_ms, int64_t needed_checkpoint) {
             auto [data, n] = token_ids_view(sequence, "sequence");
             TurnResult r;
             r.sequence.assign(data, data + n);
             r.layers = std::move(layers);
             r.cached_tokens = cached_tokens;
             r.checkpoints = std::move(checkpoints);
             r.text = std::move(text);
             r.messages = std::move(messages);
             r.prefill_ms = prefill_ms;
             r.total_ms = total_ms;
             r.needed_checkpoint = needed_checkpoint;
             return r;
           }),
           py::kw_only(), py::arg("sequence"), py::arg("layers") = std::vector<LayerStatePtr>{},
           py::arg("cached_tokens") = 0, py::arg("checkpoints") = std::vector<Checkpoint>{},
           py::arg("text") = std::string{}, py::arg("messages") = std::nullopt,
           py::arg("prefill_ms") = 0.0, py::arg("total_ms") = 0.0,
           py::arg("needed_checkpoint") = -1);

  py::class_<SettlePlan>(m, "SettlePlan")
      .def_property_readonly("target_tokens", &SettlePlan::target_tokens)
      .def_property_readonly("needed", &SettlePlan::needed)
      .def_readonly("kept_tokens", &SettlePlan::kept_tokens)
      .def_readonly("checkpoint_restored", &SettlePlan::checkpoint_restored)
      .def_readonly("version", &SettlePlan::version)
      .def_readonly("checkpoint_positions", &SettlePlan::checkpoint_positions)
      .def_property_readonly("target",
                             [](const SettlePlan& p) {
                               return at::tensor(at::ArrayRef<int64_t>(p.target),
                                                 at::TensorOptions().dtype(at::kLong));
                             })
      .def("take_layers", &SettlePlan::take_layers)
      .def("__repr__", [](const SettlePlan& p) {
        return "SettlePlan(keeps " + std::to_string(p.kept_tokens) + " of " +
               std::to_string(p.target_tokens()) + ")";
      });

  py::class_<SettleResult>(m, "SettleResult")
      .def(py::init([](int64_t settled_tokens, std::vector<LayerStatePtr> layers,
                       std::vector<Checkpoint> checkpoints) {
             return SettleResult{settled_tokens, std::move(layers), std::move(checkpoints)};
           }),
           py::kw_only(), py::arg("settled_tokens"), py::arg("layers"),
           py::arg("checkpoints") = std::vector<Checkpoint>{});

  // A context manager: `with manager.begin_turn(lease, ...) as turn: ...;
  // turn.finish(result)`; leaving the block unfinished aborts the turn.
  py::class_<Turn, TurnHolder>(m, "Turn")
      // The plan lives in the turn (and keeps it alive); take_layers() empties it.
      .def_property_readonly(
          "plan", [](Turn& turn) -> TurnPlan& { return turn.plan(); },
          py::return_value_policy::reference_internal)
      .def_property_readonly("open", &Turn::open)
      .def(
          "finish",
          [](Turn& turn, TurnResult& result) {
            py::gil_scoped_release release;
            return turn.finish(std::move(result));
          },
          py::arg("result"))
      .def("abort", &Turn::abort, py::call_guard<py::gil_scoped_release>())
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](Turn& turn, const py::args&) {
        py::gil_scoped_release release;
        turn.abort();  // nothing once finished
        return false;
      });

  // The GIL is released for each: they take session and manager locks.
  auto manager =
      py::class_<SessionManager, std::shared_ptr<SessionManager>>(m.attr("SessionManager"));
  manager
      .def(
          "begin_turn",
          [](SessionManager& mgr, const SessionLease& lease, const at::Tensor& prompt_ids,
             int64_t max_new_tokens, std::optional<CachedState> reloaded,
             std::optional<ReuseReason> plain, int64_t rewritten_tail, ReuseReason reload_reason) {
            auto [data, n] = token_ids_view(prompt_ids, "prompt_ids");
            std::optional<Turn> turn;
            {
              py::gil_scoped_release release;
              turn.emplace(mgr.begin_turn(lease, data, n, max_new_tokens, std::move(reloaded),
                                          plain, rewritten_tail, reload_reason));
            }
            return TurnHolder(new Turn(std::move(*turn)));
          },
          py::arg("lease"), py::arg("prompt_ids"), py::arg("max_new_tokens"), py::kw_only(),
          py::arg("reloaded") = std::nullopt, py::arg("plain") = std::nullopt,
          py::arg("rewritten_tail") = 0, py::arg("reload_reason") = ReuseReason::kTierReload)
      .def(
          "begin_settle",
          [](const SessionManager& mgr, const SessionLease& lease, const at::Tensor& target) {
            auto [data, n] = token_ids_view(target, "target");
            py::gil_scoped_release release;
            return mgr.begin_settle(lease, data, n);
          },
          py::arg("lease"), py::arg("target"))
      .def(
          "finish_settle",
          [](SessionManager& mgr, const SessionLease& lease, const SettlePlan& plan,
             SettleResult& result) {
            py::gil_scoped_release release;
            return mgr.finish_settle(lease, plan, std::move(result));
          },
          py::arg("lease"), py::arg("plan"), py::arg("result"));
}

}  // namespace kvchat
