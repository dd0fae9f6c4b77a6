#include "bindings.h"
#include "kvchat/chat_session.h"

namespace kvchat {

void bind_chat_session(py::module_& m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;

  py::class_<Message>(m, "Message")
      .def(py::init([](std::string role, std::string content, std::string extras) {
             return Message{std::move(role), std::move(content), std::move(extras)};
           }),
           py::arg("role"), py::arg("content"), py::arg("extras") = std::string{})
      .def_readonly("role", &Message::role)
      .def_readonly("content", &Message::content)
      .def_readonly("extras", &Message::extras);

  py::class_<Checkpoint>(m, "Checkpoint")
      .def(py::init<int64_t, std::vector<LayerStatePtr>>(), py::arg("position"), py::arg("states"))
      .def_readonly("position", &Checkpoint::position)
      .def_readonly("states", &Checkpoint::states);

  py::enum_<CheckpointPlacement>(m, "CheckpointPlacement")
      .value("last_message", CheckpointPlacement::kLastMessage)
      .value("every_message", CheckpointPlacement::kEveryMessage);
  m.attr("MIN_CHECKPOINT_GAP") = kMinCheckpointGap;

  m.def(
      "checkpoint_positions",
      [](const at::Tensor& prompt_ids, int64_t begin, const TurnMarkers& markers,
         CheckpointPlacement placement, int64_t rewritten_tail) {
        auto [data, n] = token_ids_view(prompt_ids, "prompt_ids");
        py::gil_scoped_release release;
        return checkpoint_positions(data, n, begin, markers, placement, rewritten_tail);
      },
      py::arg("prompt_ids"), py::arg("begin"), py::arg("markers"),
      py::arg("placement") = CheckpointPlacement::kEveryMessage, py::arg("rewritten_tail") = 0);

  // Built whole and read-only after: a stored record cannot be changed from Python.
  py::class_<TurnRecord>(m, "TurnRecord")
      .def(py::init([](int64_t prompt_tokens, int64_t reused_tokens, int64_t prefilled_tokens,
                       std::vector<int64_t> output_ids, int64_t checkpoint_restored,
                       double prefill_ms, double total_ms, ReuseReason reason) {
             TurnRecord r;
             r.prompt_tokens = prompt_tokens;
             r.reused_tokens = reused_tokens;
             r.prefilled_tokens = prefilled_tokens;
             r.generated_tokens = static_cast<int64_t>(output_ids.size());
             r.output_ids = std::move(output_ids);
             r.checkpoint_restored = checkpoint_restored;
             r.prefill_ms = prefill_ms;
             r.total_ms = total_ms;
             r.reason = reason;
             return r;
           }),
           py::kw_only(), py::arg("prompt_tokens"), py::arg("reused_tokens"),
           py::arg("prefilled_tokens"), py::arg("output_ids"), py::arg("checkpoint_restored") = -1,
           py::arg("prefill_ms") = 0.0, py::arg("total_ms") = 0.0, py::arg("reason"))
      .def_readonly("prompt_tokens", &TurnRecord::prompt_tokens)
      .def_readonly("reused_tokens", &TurnRecord::reused_tokens)
      .def_readonly("prefilled_tokens", &TurnRecord::prefilled_tokens)
      .def_readonly("generated_tokens", &TurnRecord::generated_tokens)
      .def_readonly("checkpoint_restored", &TurnRecord::checkpoint_restored)
      .def_readonly("prefill_ms", &TurnRecord::prefill_ms)
      .def_readonly("total_ms", &TurnRecord::total_ms)
      .def_readonly("reason", &TurnRecord::reason)
      .def_readonly("cache_stored", &TurnRecord::cache_stored)
      .def_readonly("output_ids", &TurnRecord::output_ids);

  py::class_<SessionCounters>(m, "SessionCounters")
      .def_readonly("requests", &SessionCounters::requests)
      .def_readonly("reused_tokens", &SessionCounters::reused_tokens)
      .def_readonly("prefilled_tokens", &SessionCounters::prefilled_tokens)
      .def_readonly("generated_tokens", &SessionCounters::generated_tokens)
      .def_readonly("invalidations", &SessionCounters::invalidations)
      .def_readonly("checkpoint_restores", &SessionCounters::checkpoint_restores)
      .def_readonly("checkpoints_taken", &SessionCounters::checkpoints_taken)
      .def_readonly("settles", &SessionCounters::settles)
      .def_readonly("settled_tokens", &SessionCounters::settled_tokens);

  py::class_<CacheInfo>(m, "CacheInfo")
      .def_readonly("cached_tokens", &CacheInfo::cached_tokens)
      .def_readonly("trusted_tokens", &CacheInfo::trusted_tokens)
      .def_readonly("num_layers", &CacheInfo::num_layers)
      .def_readonly("nbytes", &CacheInfo::nbytes)
      .def_readonly("dtype", &CacheInfo::dtype)
      .def_readonly("device", &CacheInfo::device)
      .def_readonly("last_check", &CacheInfo::last_check)
      .def_readonly("checkpoints", &CacheInfo::checkpoints)
      .def_readonly("checkpoint_bytes", &CacheInfo::checkpoint_bytes)
      .def_readonly("checkpoint_positions", &CacheInfo::checkpoint_positions);

  py::class_<CachedState>(m, "CachedState")
      .def(py::init([](std::vector<int64_t> ids, std::vector<LayerStatePtr> layers,
                       std::vector<Checkpoint> checkpoints, std::string text,
                       int64_t trusted_tokens) {
             return CachedState{std::move(ids), std::move(layers), std::move(checkpoints),
                                std::move(text), trusted_tokens};
           }),
           py::arg("ids"), py::arg("layers"), py::arg("checkpoints"), py::arg("text"),
           py::arg("trusted_tokens"))
      .def_readonly("ids", &CachedState::ids)
      .def_readonly("layers", &CachedState::layers)
      .def_readonly("checkpoints", &CachedState::checkpoints)
      .def_readonly("text", &CachedState::text)
      .def_readonly("trusted_tokens", &CachedState::trusted_tokens);

  // Every method that takes the session's lock releases the GIL first: the
  // core may destroy tensors under that lock, and a tensor with a Python object
  // needs the GIL to die, so a caller holding the GIL while it waits for the
  // lock would deadlock with it.
  py::class_<ChatSession, std::shared_ptr<ChatSession>>(m, "ChatSession")
      .def(py::init([](std::string id, int64_t num_layers, int64_t max_checkpoints,
                       int64_t max_checkpoint_bytes) {
             return std::make_shared<ChatSession>(
                 std::move(id), num_layers,
                 CheckpointPolicy{max_checkpoints, max_checkpoint_bytes});
           }),
           py::arg("session_id"), py::arg("num_layers") = 0, py::arg("max_checkpoints") = 8,
           py::arg("max_checkpoint_bytes") = 0)
      .def_property_readonly("id", &ChatSession::id)
      .def("add_message", &ChatSession::add_message, py::arg("role"), py::arg("content"), no_gil())
      .def("set_messages", &ChatSession::set_messages, py::arg("messages"), no_gil())
      .def("clear_messages", &ChatSession::clear_messages, no_gil())
      .def("messages", &ChatSession::messages, no_gil())
      .def_property_readonly("system_prompt",
                             py::cpp_function(&ChatSession::system_prompt, no_gil()))
      .def(
          "plan",
          [](const ChatSession& s, const at::Tensor& prompt_ids) {
            auto [data, n] = token_ids_view(prompt_ids, "prompt_ids");
            py::gil_scoped_release release;
            return s.plan(data, n);
          },
          py::arg("prompt_ids"))
      .def(
          "held_tokens",
          [](const ChatSession& s, const at::Tensor& prompt_ids) {
            auto [data, n] = token_ids_view(prompt_ids, "prompt_ids");
            py::gil_scoped_release release;
            return s.held_tokens(data, n);
          },
          py::arg("prompt_ids"))
      .def("layers_for", &ChatSession::layers_for, py::arg("plan"), no_gil())
      .def("invalidate_cache", &ChatSession::invalidate_cache, no_gil())
      .def("cached_state", &ChatSession::cached_state, no_gil())
      .def("restore", &ChatSession::restore, py::arg("state"), no_gil())
      .def_property_readonly("resident", py::cpp_function(&ChatSession::resident, no_gil()))
      .def_property_readonly("version", py::cpp_function(&ChatSession::version, no_gil()))
      .def("cache_info", &ChatSession::cache_info, no_gil())
      .def("cached_ids", &ChatSession::cached_ids, no_gil())
      .def("cached_text", &ChatSession::cached_text, no_gil())
      .def("last_turn", &ChatSession::last_turn, no_gil())
      .def("counters", &ChatSession::counters, no_gil());
}

}  // namespace kvchat
