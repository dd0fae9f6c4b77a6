#include "bindings.h"
#include "kvchat/session_manager.h"
#include "kvchat/turn.h"

namespace kvchat {

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

  // Consumed by finish_turn: its layers and checkpoints move into the session.
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

  // The GIL is released for each: they take session and manager locks.
  auto manager =
      py::class_<SessionManager, std::shared_ptr<SessionManager>>(m.attr("SessionManager"));
  manager
      .def(
          "begin_turn",
          [](SessionManager& mgr, ChatSession& session, const at::Tensor& prompt_ids,
             int64_t max_new_tokens, std::optional<CachedState> reloaded,
             std::optional<ReuseReason> plain, int64_t rewritten_tail) {
            auto [data, n] = token_ids_view(prompt_ids, "prompt_ids");
            py::gil_scoped_release release;
            return mgr.begin_turn(session, data, n, max_new_tokens, std::move(reloaded), plain,
                                  rewritten_tail);
          },
          py::arg("session"), py::arg("prompt_ids"), py::arg("max_new_tokens"), py::kw_only(),
          py::arg("reloaded") = std::nullopt, py::arg("plain") = std::nullopt,
          py::arg("rewritten_tail") = 0)
      .def(
          "finish_turn",
          [](SessionManager& mgr, ChatSession& session, const TurnPlan& plan, TurnResult& result) {
            py::gil_scoped_release release;
            return mgr.finish_turn(session, plan, std::move(result));
          },
          py::arg("session"), py::arg("plan"), py::arg("result"))
      .def("abort_turn", &SessionManager::abort_turn, py::arg("session"), py::arg("plan"),
           py::call_guard<py::gil_scoped_release>())
      .def(
          "begin_settle",
          [](const SessionManager& mgr, ChatSession& session, const at::Tensor& target) {
            auto [data, n] = token_ids_view(target, "target");
            py::gil_scoped_release release;
            return mgr.begin_settle(session, data, n);
          },
          py::arg("session"), py::arg("target"))
      .def(
          "finish_settle",
          [](SessionManager& mgr, ChatSession& session, const SettlePlan& plan,
             SettleResult& result) {
            py::gil_scoped_release release;
            return mgr.finish_settle(session, plan, std::move(result));
          },
          py::arg("session"), py::arg("plan"), py::arg("result"));
}

}  // namespace kvchat
