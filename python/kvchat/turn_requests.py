"""A call's arguments made into a checked ``TurnInput``: the chat template
rendered (and truncated when ``overflow="truncate"``), the prompt tokenized,
generate's arguments resolved, and for a streamed turn the ``ReplyStream`` its
kwargs feed. Everything here raises before a turn touches a session.
``SessionManager``'s methods document the arguments; this does the work."""

from __future__ import annotations

import json

import torch

from .arguments import ContextLengthError, check_bool, check_session_id, positive_int
from .conversation import SendBack, drop_oldest_turn
from .generate_args import resolve_generate_args
from .prediction import predicted_prefix
from .prompting import (
    check_template_kwargs,
    check_tools,
    end_ids,
    max_prompt_chars,
    render_text,
    require_chat_template,
    rewritten_tail,
    tokenize_text,
    validate_messages,
)
from .streaming import ReplyStream
from .turn import TurnInput

# Template arguments (tools, chat_template_kwargs) whose rewritten tail is remembered.
_MAX_PROBED_TEMPLATES = 256
# Arguments generate must not get from a caller: the session's cache is kvchat's.
_CACHE_ARGUMENTS = ("past_key_values", "cache_params", "cache")


def vocabulary_size(model) -> int:
    """How many token ids the model's input embedding holds (the config's
    ``vocab_size`` for a model that exposes no embedding)."""
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    if isinstance(embeddings, torch.nn.Embedding):
        return embeddings.num_embeddings
    return model.config.get_text_config().vocab_size


class RequestBuilder:
    """Builds one manager's turn requests (its model, tokenizer and context)."""

    def __init__(
        self, model, tokenizer, max_context: int | None, truncate: bool, needs_checkpoints: bool
    ):
        self._model, self._tokenizer = model, tokenizer
        self._max_context = max_context
        self._truncate = truncate and max_context is not None  # overflow="truncate"
        self._needs_checkpoints = needs_checkpoints
        self._rewrites: dict[str, int] = {}  # template arguments -> rewritten_tail

    @property
    def _max_chars(self) -> int | None:
        """A text longer than this is over the context whatever its tokens:
        refused before tokenizing, which would cost time and memory for nothing."""
        if self._max_context is None:
            return None
        return max_prompt_chars(self._tokenizer, self._max_context)

    # ------------------------------------------------------------------ chat
    def chat(
        self,
        session_id,
        messages,
        tools,
        template_kwargs,
        settle,
        kwargs: dict,
        streaming: bool,
        skip_special_tokens: bool = True,
    ) -> tuple[TurnInput, ReplyStream | None]:
        """A chat turn, checked: its TurnInput, and for ``streaming`` the
        ReplyStream whose streamer and stop its generate kwargs carry."""
        check_bool(skip_special_tokens, "skip_special_tokens")
        text, ids, messages = self._chat_text(
            session_id, messages, kwargs["max_new_tokens"], tools, template_kwargs
        )
        check_bool(settle, "settle")
        stream = self.reply_stream(kwargs, skip_special_tokens) if streaming else None
        args = resolve_generate_args(self._model, stream.kwargs if stream else kwargs, ids.numel())
        tail = self._rewritten_tail(tools, template_kwargs)
        sendback = SendBack(messages, tools, template_kwargs, settle)
        return TurnInput(session_id, args, ids, text, sendback, rewritten_tail=tail), stream

    def _chat_text(self, session_id, messages, max_new_tokens, tools, template_kwargs):
        """(prompt text, its token ids, messages), truncated when overflow='truncate'."""
        check_session_id(session_id)
        positive_int(max_new_tokens, "max_new_tokens")
        messages = self.check_conversation(messages, tools, template_kwargs)
        limit = self._max_chars

        def render(messages):
            text = render_text(self._tokenizer, messages, tools, template_kwargs)
            if limit is not None and len(text) > limit:
                return text, None
            return text, tokenize_text(self._tokenizer, text)

        def over(ids) -> bool:
            return ids is None or ids.numel() + max_new_tokens > self._max_context

        text, ids = render(messages)
        if self._truncate:
            while over(ids) and (shorter := drop_oldest_turn(messages)):
                messages = shorter
                text, ids = render(messages)
        if ids is None:
            raise ContextLengthError(
                f"prompt of {len(text)} characters (more than {self._max_context} tokens) plus "
                f"max_new_tokens={max_new_tokens} exceeds max_context_length={self._max_context}"
            )
        return text, ids, messages

    def check_conversation(self, messages, tools, template_kwargs) -> list[dict]:
        """The messages, checked with the template arguments they are rendered with."""
        require_chat_template(self._tokenizer)
        messages = validate_messages(messages)
        check_tools(tools)
        check_template_kwargs(template_kwargs, self._tokenizer)
        return messages

    def _rewritten_tail(self, tools, template_kwargs) -> int:
        """rewritten_tail() for these template arguments, probed once each:
        only models that take checkpoints need it."""
        if not self._needs_checkpoints:
            return 0
        key = json.dumps([tools, template_kwargs], sort_keys=True, default=repr)
        if key not in self._rewrites:
            if len(self._rewrites) >= _MAX_PROBED_TEMPLATES:
                self._rewrites.clear()  # a server's clients may send endless tool sets
            self._rewrites[key] = rewritten_tail(self._tokenizer, tools, template_kwargs)
        return self._rewrites[key]

    def settle_target(self, messages, tools, template_kwargs) -> torch.Tensor | None:
        """The ids a next turn sending back ``messages`` starts with (None:
        nothing to settle to); rendered here, so a history the template
        refuses, or one that leaves no room for a next turn, raises here."""
        target = predicted_prefix(
            self._tokenizer, messages, tools, template_kwargs, self._max_chars
        )
        if target is not None and self._max_context is not None:
            if target.numel() >= self._max_context:
                raise ContextLengthError(
                    f"messages: the history is {target.numel()} tokens, which leaves no room "
                    f"for a next turn within max_context_length={self._max_context}"
                )
        return target

    # -------------------------------------------------------------- generate
    def generate(self, input_ids, session_id: str, generate_kwargs: dict) -> TurnInput:
        """generate()'s turn, for one unpadded sequence."""
        if input_ids.shape[1] == 0:
            raise ValueError("input_ids must hold at least one token")
        args = resolve_generate_args(self._model, generate_kwargs, input_ids.shape[1])
        return TurnInput(session_id, args, input_ids[0].long())

    def stream_generate(
        self, input_ids, session_id: str, skip_special_tokens, generate_kwargs: dict
    ) -> tuple[TurnInput, ReplyStream]:
        self.check_ids(input_ids, session_id, generate_kwargs, "stream_generate")
        check_bool(skip_special_tokens, "skip_special_tokens")
        if input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            shape = tuple(input_ids.shape)
            raise ValueError(f"input_ids must be one sequence of at least one token, got {shape}")
        ids = input_ids[0].long()
        max_new = generate_kwargs.get("max_new_tokens")
        if max_new is None:
            max_new = self._model.generation_config.max_new_tokens or 0
        if self._max_context is not None and ids.numel() + max_new > self._max_context:
            raise ContextLengthError(
                f"the prompt ({ids.numel()} tokens) and max_new_tokens ({max_new}) exceed "
                f"max_context_length ({self._max_context})"
            )
        stream = self.reply_stream(generate_kwargs, skip_special_tokens)
        args = resolve_generate_args(self._model, stream.kwargs, ids.numel())
        return TurnInput(session_id, args, ids), stream

    def reply_stream(self, kwargs: dict, skip_special_tokens: bool) -> ReplyStream:
        """The stream a turn's generate kwargs feed; the ids that end the reply
        (this call's eos_token_id, else the model's) are never text."""
        generation_config = self._model.generation_config
        ends = end_ids(self._tokenizer, generation_config, kwargs.get("eos_token_id"))
        return ReplyStream(self._tokenizer, kwargs, skip_special_tokens, ends)

    def check_ids(self, input_ids, session_id: str, generate_kwargs: dict, method: str) -> None:
        check_session_id(session_id)
        for name in _CACHE_ARGUMENTS:
            if name in generate_kwargs:
                raise ValueError(
                    f"{name} is managed by kvchat; do not pass it to SessionManager.{method}"
                )
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be a 2-D tensor [batch, tokens], got "
                f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
            )
        if input_ids.dtype not in (torch.long, torch.int32):
            raise ValueError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
        # Checked here: the embedding's own IndexError names neither the id nor the table.
        vocab = vocabulary_size(self._model)
        if input_ids.numel() and (input_ids.min() < 0 or input_ids.max() >= vocab):
            bad = input_ids[(input_ids < 0) | (input_ids >= vocab)][0].item()
            raise ValueError(
                f"input_ids holds token id {bad}, outside the model's vocabulary of {vocab} "
                f"(ids 0 to {vocab - 1}); tokenize with the model's own tokenizer"
            )
