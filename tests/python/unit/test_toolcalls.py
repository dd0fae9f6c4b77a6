"""Tool calls parsed out of replies, per format, on text the real chat
templates render (llama.cpp's copies, ``build/llama-cpp``): an assistant
message with ``tool_calls`` is rendered, and what the model would have written
after the generation prompt is parsed back, whole and streamed in pieces split
at every position. No model runs here."""

from __future__ import annotations

import functools
import json
import re

import pytest
from kvchat.agents import Content, ToolCall, ToolCallParser, detect
from kvchat.agents.formats import HARMONY, HERMES, LLAMA3_JSON, MINIMAX, ToolFormat
from kvchat.prompting import render_text
from kvchat.tiny import tiny_tokenizer
from llama_cpp_models import fetch

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
ARGS = [{"city": "Paris", "days": 3}, {"city": "Rome", "days": 1}]
# template (llama.cpp's file stem) -> the format chosen for it
CASES = {
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "Qwen-QwQ-32B": "hermes",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes",
    "ibm-granite-granite-4.0": "hermes",
    "ibm-granite-granite-4.1": "hermes",
    "Bielik-11B-v3.0-Instruct": "hermes",
    "MiMo-VL": "hermes",
    "Reka-Edge": "hermes",
    "unsloth-Apriel-1.5": "apriel",
    "Apriel-1.6-15b-Thinker-fixed": "apriel",
    "MiniMax-M1": "minimax-m1",
    "Qwen3.5-4B": "qwen-xml",
    "Qwen3-Coder": "qwen-xml",
    "StepFun3.5-Flash": "qwen-xml",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen-xml",
    "GLM-4.6": "glm",
    "GLM-4.7-Flash": "glm",
    "inclusionai-ling-3.0-flash": "glm",
    "poolside-Laguna-XS.2": "glm",
    "poolside-Laguna-S-2.1": "glm",
    "Spark2.5": "glm",
    "moonshotai-Kimi-K2": "kimi-k2",
    "deepseek-ai-DeepSeek-V3.1": "deepseek-v3.1",
    "MiniMax-M2": "minimax",
    "LFM2.5-8B-A1B": "lfm2",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
    "Mistral-Small-3.2-24B-Instruct-2506": "mistral-v11",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral-v11",
    "unsloth-mistral-Devstral-Small-2507": "mistral-v11",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3-json",
    "meta-llama-Llama-3.2-3B-Instruct": "llama3-json",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3-json",
    "openai-gpt-oss-120b": "harmony",
    "NVIDIA-Nemotron-Nano-v2": "nemotron-v2",
    "ByteDance-Seed-OSS": "seed-oss",
    "tencent-Hy3": "hy3",
    "deepseek-ai-DeepSeek-V3.2": "deepseek-v3.2",
    "deepseek-ai-DeepSeek-V4": "deepseek-v4",
    "deepseek-ai-DeepSeek-V4-Flash-0731": "deepseek-v4",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek-r1",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "cohere",
    "Cohere2MoE": "cohere",
    "GigaChat3.1-10B-A1.8B": "gigachat",
    "google-gemma-4-31B-it": "gemma4",
    "google-gemma-4-31B-it-interleaved": "gemma4",
    "upstage-Solar-Open-100B": "solar",
    "Apertus-8B-Instruct": "apertus",
    "Kimi-K3": "kimi-k3",
    "MiniMax-M3": "minimax-m3",
    "openbmb-MiniCPM5-1B": "minicpm",
}
# What a model ends its turn with, in these templates (the reply is cut there).
ENDS = (
    "<|call|>",
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|observation|>",
    "<|end|>",
    "</s>",
    "<sep>",
    "<|role_end|>",
    "</assistant>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>",
    "[e~[",  # MiniMax
    "<SPECIAL_12>",  # Nemotron Nano v2
    "<seed:eos>",
    "<｜hy_eos:opensource｜>",
    "<|END_OF_TURN_TOKEN|>",  # Cohere
    "<|message_sep|>",  # GigaChat
    "<turn|>",  # Gemma 4
    "<|tool_response>",
    "<end_of_sentence>",  # MiniMax-M1
    "<|end_of_msg|>",  # Kimi-K3
)


@functools.cache
def _tokenizer(template: str):
    """Only the template's text matters here: the tiny tokenizer carries it."""
    return tiny_tokenizer(chat_template=(fetch() / "templates" / f"{template}.jinja").read_text())


def _calls(count: int) -> list[dict]:
    return [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": a}}
        for i, a in zip(("abc123xyz", "def456uvw")[:count], ARGS[:count], strict=True)
    ]


@functools.cache
def _rendered_reply(template: str, content: str) -> tuple[str, int]:
    """(what the model writes after the generation prompt for a message with
    ``content`` and two tool calls, or one where the template takes only one,
    up to its end-of-turn text; how many calls)."""
    tokenizer = _tokenizer(template)
    user = [{"role": "user", "content": "The weather?"}]
    prompt = tokenizer.apply_chat_template(
        user, tools=[WEATHER], add_generation_prompt=True, tokenize=False
    )
    for count in (2, 1):
        try:
            full = tokenizer.apply_chat_template(
                [*user, {"role": "assistant", "content": content, "tool_calls": _calls(count)}],
                tools=[WEATHER],
                tokenize=False,
            )
        except Exception:  # a template that takes one call at a time (Llama 3.x)
            continue
        if count == 1 or "Rome" in full:  # not one that renders only the first (gpt-oss)
            break
    # Where the history departs from the prompt (a template that rewrites its
    # generation prompt, an opening <think> say, departs inside it): from the
    # end of the line or tag before.
    start = 0
    while start < min(len(prompt), len(full)) and prompt[start] == full[start]:
        start += 1
    if start < len(prompt):
        start = max(full.rfind("\n", 0, start), full.rfind(">", 0, start)) + 1
    reply = full[start:]
    cut = min((reply.find(end) for end in ENDS if end in reply), default=len(reply))
    return reply[:cut], count


def _parse(fmt: ToolFormat, pieces: list[str]) -> tuple[str, list[ToolCall], list]:
    parser = ToolCallParser(fmt, [WEATHER])
    out = [item for piece in pieces for item in parser.feed(piece)] + parser.finish()
    content = "".join(item.text for item in out if isinstance(item, Content))
    calls = [item for item in out if isinstance(item, ToolCall)]
    assert content == parser.content and calls == parser.calls
    return content, calls, out


def _arguments(calls: list[ToolCall]) -> list[dict]:
    assert all(c.name == "get_weather" for c in calls)
    return [json.loads(c.arguments) for c in calls]


@pytest.mark.parametrize("template", sorted(CASES))
def test_the_format_is_chosen_from_the_template(template):
    fmt = detect(_tokenizer(template))
    assert fmt is not None and fmt.name == CASES[template]


@pytest.mark.parametrize(
    "template",
    [
        "google-gemma-2-2b-it",  # no tools at all
        "microsoft-Phi-3.5-mini-instruct",
        "muse-glimmer",
    ],
)
def test_a_template_whose_markup_kvchat_does_not_read_has_no_format(template):
    assert detect(_tokenizer(template)) is None


@pytest.mark.parametrize("template", sorted(CASES))
def test_rendered_calls_parse_back_whole_and_split_at_every_position(template):
    fmt = detect(_tokenizer(template))
    reply, count = _rendered_reply(template, "")
    content, calls, _ = _parse(fmt, [reply])
    assert _arguments(calls) == ARGS[:count]  # "days" is an integer, as the tool says
    # What the template writes before the calls: at most an empty reasoning block.
    # (MiniMax-M3's and Kimi-K3's end of reasoning.)
    assert "".join(content.split()) in (
        "",
        "<think></think>",
        "</think>",
        "</mm:think>",
        "<|close|>think<|sep|><|open|>response<|sep|>",
    ), content
    assert len({c.id for c in calls}) == count
    for i in range(1, len(reply)):
        split = _parse(fmt, [reply[:i], reply[i:]])
        assert (split[0], _arguments(split[1])) == (content, ARGS[:count]), i
    by_char = _parse(fmt, list(reply))
    assert (by_char[0], _arguments(by_char[1])) == (content, ARGS[:count])


# Templates that drop an assistant's content beside its tool calls, or its
# calls beside content (Nemotron Nano v2), or render the content after the
# calls (Gemma 4); and Llama's, whose call is the whole reply; gpt-oss's,
# which renders it as its reasoning, held with the reply to its end.
NO_CONTENT = {
    "openai-gpt-oss-120b",
    "NVIDIA-Nemotron-Nano-v2",
    "MiniMax-M1",
    "Cohere2MoE",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
    "google-gemma-4-31B-it",
    "google-gemma-4-31B-it-interleaved",
    "upstage-Solar-Open-100B",
    "Mistral-Small-3.2-24B-Instruct-2506",
    "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
    "mistralai-Mistral-Nemo-Instruct-2407",
    *(t for t in CASES if CASES[t] == "llama3-json"),
}


@pytest.mark.parametrize("template", sorted(set(CASES) - NO_CONTENT))
def test_content_before_the_calls_streams_before_them(template):
    """Text before the section is given out as it comes, not held to the end."""
    fmt = detect(_tokenizer(template))
    reply, count = _rendered_reply(template, "Let me look that up.")
    assert "Let me look that up." in reply
    parser = ToolCallParser(fmt, [WEATHER])
    given = ""
    for char in reply:
        given += "".join(i.text for i in parser.feed(char) if isinstance(i, Content))
    assert "Let me look that up." in given
    assert not parser.calls  # announced only once the reply ends
    rest = parser.finish()
    assert _arguments([i for i in rest if isinstance(i, ToolCall)]) == ARGS[:count]


@pytest.mark.parametrize("template", sorted(CASES))
def test_markup_that_does_not_parse_stays_text(template):
    """A call cut short (max_tokens ran out inside its JSON) is the reply's
    text, character for character, never an error."""
    fmt = detect(_tokenizer(template))
    reply, _ = _rendered_reply(template, "")
    cut = reply[: reply.index("Paris") + 3]
    for pieces in ([cut], list(cut)):
        content, calls, _ = _parse(fmt, pieces)
        assert calls == [] and content == cut


@pytest.mark.parametrize(
    "text",
    [
        "Use <tool_call> tags to call a tool.",
        "<tool_call>\nnot json\n</tool_call>",
        '<tool_call>\n{"arguments": {}}\n</tool_call>',  # no name
        "plain text that ends in <tool_",
        "",
    ],
)
def test_text_without_a_valid_call_is_given_back_unchanged(text):
    for pieces in ([text], list(text)):
        content, calls, _ = _parse(HERMES, pieces)
        assert calls == [] and content == text


def test_llama_json_must_be_the_whole_reply():
    prose = 'The call would be {"name": "get_weather", "parameters": {}} here.'
    content, calls, _ = _parse(LLAMA3_JSON, list(prose))
    assert calls == [] and content == prose
    call = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    content, calls, _ = _parse(LLAMA3_JSON, [call])
    assert content == "" and _arguments(calls) == [{"city": "Oslo"}]
    # A JSON answer is not a call: it must name a tool and carry arguments.
    for answer in ('{"name": "Alice", "age": 3}', '{"name": "get_weather"}'):
        content, calls, _ = _parse(LLAMA3_JSON, [answer])
        assert calls == [] and content == answer


def test_mistral_ids_are_nine_letters_or_digits():
    """Mistral's templates refuse any other id when the call is sent back."""
    fmt = detect(_tokenizer("mistralai-Mistral-Nemo-Instruct-2407"))
    _, calls, _ = _parse(fmt, [_rendered_reply("mistralai-Mistral-Nemo-Instruct-2407", "")[0]])
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    _, calls, _ = _parse(HERMES, ['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'])
    assert calls[0].id.startswith("call_")


def test_a_tokenizers_own_response_template_comes_first():
    """transformers' response parsing, with the template the tokenizer carries."""
    tokenizer = tiny_tokenizer()
    tokenizer.response_template = {
        "defaults": {"role": "assistant"},
        "start_anchor": "<|im_start|>assistant\n",
        "fields": {
            "tool_calls": {
                "open": "<call>",
                "close": "</call>",
                "repeats": True,
                "content": "json",
                "transform": {"type": "function", "function": "{content}"},
            },
            "content": {"content": "text"},
        },
    }
    fmt = detect(tokenizer)
    assert fmt.name == "response_template"
    content, calls, _ = _parse(fmt, list('Sure.<call>{"name": "f", "arguments": {"x": 1}}</call>'))
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("f", {"x": 1})
    ]


@pytest.mark.parametrize(
    "arguments",
    ['{"x": NaN}', '{"x": 1e999}', '{"x": Infinity}', '"a string"', "[1, 2]", "5"],
)
def test_arguments_that_are_not_a_strict_json_object_stay_text(arguments):
    """JSON clients parse the arguments: NaN and Infinity are not JSON, and
    a call's arguments are an object."""
    text = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    content, calls, _ = _parse(HERMES, [text])
    assert calls == [] and content == text


@pytest.mark.parametrize("template", sorted(CASES))
def test_arguments_sent_back_as_json_text_render_as_the_model_wrote_them(template):
    """OpenAI clients send a call's arguments back as JSON text. Templates
    that iterate them (Qwen3.5, GLM) or apply tojson to them (Qwen2.5,
    Llama) get the object they hold: the history renders as it does with
    object arguments, never refused and never an escaped string."""
    tokenizer = _tokenizer(template)
    user = [{"role": "user", "content": "The weather?"}]
    count = _rendered_reply(template, "")[1]
    as_objects, as_text = (
        [*user, {"role": "assistant", "content": "", "tool_calls": calls}]
        for calls in (
            _calls(count),
            [
                {
                    **c,
                    "function": {
                        **c["function"],
                        "arguments": json.dumps(c["function"]["arguments"]),
                    },
                }
                for c in _calls(count)
            ],
        )
    )
    want = render_text(tokenizer, as_objects, [WEATHER])
    assert render_text(tokenizer, as_text, [WEATHER]) == want
    assert '\\"city\\"' not in want


@pytest.mark.parametrize(
    "template",
    [
        None,  # kvchat's tiny ChatML
        "NousResearch-Hermes-3-Llama-3.1-8B-tool_use",
        "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use",
    ],
)
def test_a_template_that_writes_text_arguments_keeps_them_as_sent(template):
    """Templates that write text arguments as they are (an ``is string``
    check) get them as sent: compact JSON the model wrote stays compact, so
    the history is what it wrote. Hermes' templates read the tool's
    description, which the probe must not trip on."""
    tokenizer = tiny_tokenizer() if template is None else _tokenizer(template)
    compact = '{"city":"Paris"}'
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": compact},
    }
    messages = [
        {"role": "user", "content": "The weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    assert compact in render_text(tokenizer, messages, [WEATHER])


# gpt-oss's replies as it writes them (the decode drops "<|call|>" and
# "<|return|>", which end the reply): reasoning, then a call addressed in the
# channel's header, or a preamble and a call, or an answer.
HARMONY_REPLIES = {
    "reasoned call": (
        "<|channel|>analysis<|message|>The user wants Paris.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather "
        '<|constrain|>json<|message|>{"city": "Paris", "days": 3}',
        "",
        [{"city": "Paris", "days": 3}],
    ),
    "preamble and call": (
        "<|channel|>commentary<|message|>Checking the forecast.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather json"
        '<|message|>{"city": "Rome", "days": 1}',
        "Checking the forecast.",
        [{"city": "Rome", "days": 1}],
    ),
    "call from analysis": (
        '<|channel|>analysis to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}',
        "",
        [{"city": "Oslo"}],
    ),
    "reasoning cut short after its message": (
        "<|channel|>analysis<|message|>Hmm.<|end|><|start|>assistant",
        "",
        [],
    ),
    "preamble and answer": (
        "<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny.",
        "Checking.\n\nIt is sunny.",
        [],
    ),
    "a built-in tool's call": (  # not a function: its markup is content, reasoning is not
        "<|channel|>analysis<|message|>Look it up.<|end|>"
        '<|start|>assistant<|channel|>analysis to=browser.search code<|message|>{"q": "x"}',
        '<|channel|>analysis to=browser.search code<|message|>{"q": "x"}',
        [],
    ),
    "answer": (
        "<|channel|>analysis<|message|>Easy.<|end|>"
        "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.",
        "It is sunny in Paris.",
        [],
    ),
    "no channels": ("It is sunny in Paris.", "It is sunny in Paris.", []),
}


@pytest.mark.parametrize("reply", sorted(HARMONY_REPLIES))
def test_harmony_channels_give_the_call_or_the_final_answer(reply):
    """The analysis channel is reasoning, not content; a call is read from
    a commentary channel with a recipient; content is the final (or the
    commentary preamble's) text, whole or split at every position."""
    text, content, arguments = HARMONY_REPLIES[reply]
    for pieces in [[text]] + [[text[:i], text[i:]] for i in range(1, len(text))]:
        got, calls, _ = _parse(HARMONY, pieces)
        assert (got, _arguments(calls)) == (content, arguments), pieces


def _call_markup(text: str) -> str:
    """A harmony reply's text from its first call's header on."""
    start = text.find("<|start|>assistant<|channel|>commentary to=")
    return text[max(start, 0) :]


def test_a_harmony_call_cut_short_stays_its_text():
    """Cut inside its JSON (max_tokens), the call is text, as it came; the
    reasoning before it is not content even then."""
    text = HARMONY_REPLIES["reasoned call"][0]
    cut = text[: text.index('"Paris') + 4]
    for pieces in ([cut], list(cut)):
        content, calls, _ = _parse(HARMONY, pieces)
        assert calls == [] and content == _call_markup(cut), pieces
        assert "The user wants Paris." not in content


def test_markers_a_tokenizer_added_as_special_tokens_are_written_as_those_tokens():
    """gpt-oss's and LFM2's markers are added special tokens, not all in
    all_special_tokens: a forced call writes the token the model was
    trained on, not the marker spelled out in pieces."""
    from kvchat.agents.grammar import Grammars
    from tokenizers import AddedToken

    tokenizer = tiny_tokenizer()
    tokenizer.add_tokens([AddedToken("<|channel|>", special=True)])
    channel = tokenizer.convert_tokens_to_ids("<|channel|>")
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert grammars._literal("a<|channel|>b") == f'"a" <[{channel}]> "b"'


def test_a_harmony_answer_as_gpt_oss_s_template_renders_it():
    """The reasoning and final answer gpt-oss's template renders for an
    assistant message (what the model writes after the generation prompt, up
    to the "<|return|>" that ends it): the answer is the content, whole and
    split at every position."""
    tokenizer = _tokenizer("openai-gpt-oss-120b")
    user = [{"role": "user", "content": "The weather?"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    answer = {"role": "assistant", "thinking": "The user asks.", "content": "Sunny, 21 C."}
    full = tokenizer.apply_chat_template([*user, answer], tokenize=False)
    assert full.startswith(prompt)
    reply = full[len(prompt) :].split("<|return|>")[0]
    assert "The user asks." in reply
    for pieces in [[reply]] + [[reply[:i], reply[i:]] for i in range(1, len(reply))]:
        content, calls, _ = _parse(HARMONY, pieces)
        assert (content, calls) == ("Sunny, 21 C.", []), pieces


def _streamed(parser: ToolCallParser, pieces: list[str]) -> tuple[str, list]:
    """(the content given out before the reply ended, everything given out)."""
    early = [item for piece in pieces for item in parser.feed(piece)]
    out = early + parser.finish()
    return "".join(item.text for item in early if isinstance(item, Content)), out


@pytest.mark.parametrize("reply", ["answer", "preamble and answer"])
def test_a_harmony_answer_streams_as_it_is_written(reply):
    """The final channel's text goes out as it comes, not at the reply's end;
    the analysis channel never does. Fed token-sized pieces (every marker is
    one token) and split at every position."""
    text, content, _ = HARMONY_REPLIES[reply]
    tokens = [t for t in re.split(r"(<\|[a-z]+\|>)", text) if t]
    splits = [tokens] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in splits:
        early, out = _streamed(ToolCallParser(HARMONY, [WEATHER]), pieces)
        assert "".join(i.text for i in out if isinstance(i, Content)) == content, pieces
        assert content.startswith(early) and "<|" not in early, pieces  # no reasoning, no markup
        if pieces is tokens:  # all of the answer is out before the reply ends
            assert early == content


def test_a_preamble_streams_before_its_call():
    text, content, arguments = HARMONY_REPLIES["preamble and call"]
    tokens = [t for t in re.split(r"(<\|[a-z]+\|>)", text) if t]
    early, out = _streamed(ToolCallParser(HARMONY, [WEATHER]), tokens)
    assert early == content == "Checking the forecast."
    calls = [i for i in out if isinstance(i, ToolCall)]
    assert _arguments(calls) == arguments and isinstance(out[-1], ToolCall)


def test_a_streamed_preamble_then_a_call_cut_short_gives_the_call_as_text():
    """The preamble is out already; the call that does not parse follows it
    as the markup it was (not the reply again from its start)."""
    text = HARMONY_REPLIES["preamble and call"][0]
    cut = text[: text.index('"Rome') + 3]
    for pieces in ([cut], list(cut)):
        content, calls, _ = _parse(HARMONY, pieces)
        call = cut[cut.index("<|start|>assistant<|channel|>commentary to=") :]
        assert calls == [] and content == "Checking the forecast." + call, pieces


@pytest.mark.parametrize("reply", sorted(HARMONY_REPLIES))
def test_a_harmony_reply_without_tools_gives_its_answer_and_no_call(reply):
    """A request with no tools (or tool_choice "none") still gets the final
    answer out of gpt-oss's channels, and a call it writes anyway stays text."""
    text, content, arguments = HARMONY_REPLIES[reply]
    parser = ToolCallParser(HARMONY, None, calls=False)
    out = parser.feed(text) + parser.finish()
    assert not [i for i in out if isinstance(i, ToolCall)]
    got = "".join(i.text for i in out if isinstance(i, Content))
    # The answer (a preamble here), then any call as it came; never the reasoning.
    assert got == content + (_call_markup(text) if arguments else "")


@pytest.mark.parametrize(
    "value",
    ["x</parameter>y", "a</invoke>b", "<b>bold</b>", "5 < 6"],
)
def test_a_minimax_value_holding_its_closing_tag_is_text_not_a_short_call(value):
    """A value with "</parameter>" in it would be read short, one with
    "</invoke>" would close the call early: the reply is then text, as
    written. Other tags in a value are read as written."""
    text = (
        '\n<minimax:tool_call>\n<invoke name="get_weather">\n'
        f'<parameter name="city">{value}</parameter>\n</invoke>\n</minimax:tool_call>'
    )
    for pieces in ([text], list(text)):
        content, calls, _ = _parse(MINIMAX, pieces)
        if "</parameter>" in value or "</invoke>" in value:
            assert calls == [] and content == text, pieces
        else:
            assert content.strip() == "" and _arguments(calls) == [{"city": value}], pieces
