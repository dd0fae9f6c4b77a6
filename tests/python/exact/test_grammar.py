"""The grammars constrained turns run under, without a model: a seeded random
walk through each grammar (any allowed token, as a model might pick) writes
text that the same format's parser reads back as calls of the given tools
with arguments their schemas allow, or as the JSON the schema allows."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from grammar_walks import TOOLS, tiny_grammars, walk
from kvchat.agents import ToolCall, ToolCallParser
from kvchat.agents.formats import (
    APRIEL,
    COHERE,
    DEEPSEEK_R1,
    DEEPSEEK_V4,
    DEEPSEEK_V31,
    DEEPSEEK_V32,
    GEMMA4,
    GIGACHAT,
    GIGACHAT_3,
    GLM,
    HARMONY,
    HERMES,
    HY3,
    KIMI,
    LFM2,
    LLAMA3_JSON,
    MINICPM,
    MINIMAX,
    MINIMAX_M1,
    MISTRAL_V3,
    MISTRAL_V11,
    NEMOTRON_V2,
    QWEN_XML,
    SEED_OSS,
    SOLAR,
)
from kvchat.agents.grammar import GrammarError, Grammars
from kvchat.tiny import tiny_tokenizer

ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}},
    "required": ["ok"],
    "additionalProperties": False,
}
CONSTRAINABLE = [
    HERMES,
    APRIEL,
    MISTRAL_V3,
    MISTRAL_V11,
    KIMI,
    DEEPSEEK_V31,
    LLAMA3_JSON,
    QWEN_XML,
    GLM,
    MINIMAX,
    LFM2,
    HARMONY,
    NEMOTRON_V2,
    COHERE,
    SEED_OSS,
    HY3,
    DEEPSEEK_V32,
    DEEPSEEK_V4,
    DEEPSEEK_R1,
    GIGACHAT,
    MINIMAX_M1,
    MINICPM,
    GIGACHAT_3,
]


def _read(fmt, text: str) -> tuple[str, list[ToolCall]]:
    parser = ToolCallParser(fmt, TOOLS)
    parser.feed(text)
    parser.finish()
    return parser.content, parser.calls


def _allowed(call: ToolCall) -> bool:
    arguments = json.loads(call.arguments)
    if call.name == "get_weather":
        return arguments["unit"] in ("c", "f") and isinstance(arguments["hourly"], bool)
    return call.name == "get_time" and arguments == {"zone": arguments["zone"]}


@pytest.mark.parametrize("fmt", CONSTRAINABLE, ids=lambda f: f.name)
@pytest.mark.parametrize("parallel", [False, True], ids=["one", "parallel"])
def test_what_a_tool_grammar_lets_a_model_write_parses_as_calls(fmt, parallel):
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(fmt, TOOLS, parallel=parallel)
    counts = set()
    for seed in range(12):
        # Long markup (Hy3's tags, spelled byte by byte here) takes a long walk.
        text = walk(grammars, grammar, seed, limit=4000)
        content, calls = _read(fmt, text)
        assert calls and all(_allowed(c) for c in calls), text
        assert content.strip() == "", text
        counts.add(len(calls))
    if not parallel or fmt in (LLAMA3_JSON, HARMONY, GIGACHAT, GIGACHAT_3):  # one call a reply
        assert counts == {1}


def test_a_named_function_is_the_only_one_the_grammar_allows():
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(HERMES, TOOLS[1:], parallel=False)
    for seed in range(8):
        _, calls = _read(HERMES, walk(grammars, grammar, seed))
        assert [c.name for c in calls] == ["get_time"]


@pytest.mark.parametrize("fmt", [HERMES, MISTRAL_V11, LLAMA3_JSON, COHERE], ids=lambda f: f.name)
def test_tools_beside_a_json_format_allow_a_call_or_the_json(fmt):
    """tool_choice auto with a response_format: the model may call a tool, or
    answer in the format; both are read back as what they are."""
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(fmt, TOOLS, parallel=False, or_json=ANSWER)
    kinds = set()
    for seed in range(24):
        text = walk(grammars, grammar, seed)
        content, calls = _read(fmt, text)
        if calls:
            assert content.strip() == "" and all(_allowed(c) for c in calls), text
            kinds.add("call")
        else:
            assert isinstance(json.loads(content)["ok"], bool), text
            kinds.add("json")
    assert kinds == {"call", "json"}


def test_markup_kvchat_cannot_constrain_is_refused_by_name():
    # A tokenizer's own response_template: kvchat does not know how it writes calls.
    own = dataclasses.replace(HERMES, name="response_template", grammar=None)
    with pytest.raises(GrammarError, match="response_template") as error:
        tiny_grammars().tool_calls(own, TOOLS)
    assert error.value.param == "tool_choice"
    # Gemma 4's arguments are not JSON; Solar's calls carry the model's own ids.
    for fmt in (GEMMA4, SOLAR):
        with pytest.raises(GrammarError, match=fmt.name) as error:
            tiny_grammars().tool_calls(fmt, TOOLS)
        assert error.value.param == "tool_choice"


# A string written as its text, an integer and a number as JSON, an optional
# parameter, and a nested object: what the XML formats write untyped, read
# back typed by the schema.
BOOKING = {
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "nights": {"type": "integer"},
                "budget": {"type": "number", "minimum": 0, "maximum": 1000},
                "note": {"type": "string"},
                "guests": {
                    "type": "object",
                    "properties": {"adults": {"type": "integer"}},
                    "required": ["adults"],
                    "additionalProperties": False,
                },
            },
            "required": ["city", "nights", "budget", "guests"],
        },
    },
}


@pytest.mark.parametrize(
    "fmt", [QWEN_XML, GLM, MINIMAX, SEED_OSS, HY3, DEEPSEEK_V32], ids=lambda f: f.name
)
def test_xml_parameters_are_written_as_the_template_writes_them_and_read_back_typed(fmt):
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(fmt, [BOOKING], parallel=False)
    notes, cities = set(), set()
    for seed in range(16):
        text = walk(grammars, grammar, seed, close=fmt.grammar.xml[2])
        parser = ToolCallParser(fmt, [BOOKING])
        parser.feed(text)
        parser.finish()
        assert parser.content.strip() == "" and len(parser.calls) == 1, text
        arguments = json.loads(parser.calls[0].arguments)
        assert isinstance(arguments["city"], str), text
        cities.add(arguments["city"].strip())
        # The text the walk wrote for the city, up to its tag, is what is read back.
        tag = fmt.grammar.xml[2].strip()
        written = text.split(fmt.grammar.xml[1].join(("city", "")), 1)[1].split(tag, 1)[0]
        assert written.strip() == arguments["city"].strip(), text
        assert type(arguments["nights"]) is int, text
        assert isinstance(arguments["budget"], (int, float)), text
        assert type(arguments["guests"]["adults"]) is int, text
        assert set(arguments) <= set(BOOKING["function"]["parameters"]["properties"]), text
        notes.add("note" in arguments)
    assert notes == {True, False}  # the optional one is sometimes written
    assert len(cities) > 8  # free text, not one forced value


def test_a_schema_llguidance_refuses_names_the_field():
    grammars = tiny_grammars()
    with pytest.raises(GrammarError) as error:
        grammars.processor(grammars.json_schema({"type": "nonsense"}), "response_format")
    assert error.value.param == "response_format" and "nonsense" in str(error.value)


# Schemas llguidance 1.9.1 builds but refuses on the first token every reply
# writes ("{"): a row of more than 2,000 alternatives; an object that must
# hold itself.
BRANCHES_2001 = {
    "anyOf": [
        {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
        for i in range(2001)
    ]
}
ITSELF = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
SELF_REFERENCE = {"$defs": {"n": ITSELF}, "$ref": "#/$defs/n"}
# Refused only a few tokens into the reply, after `{"a": ` and a boolean.
REFUSED_LATER = {
    "type": "object",
    "properties": {"a": {"type": "boolean"}, "n": {"$ref": "#/$defs/n"}},
    "required": ["a", "n"],
    "$defs": {"n": ITSELF},
}


@pytest.mark.parametrize(
    "schema, says",
    [
        (BRANCHES_2001, "Current row has 2001 items"),
        (SELF_REFERENCE, "Too many items"),
        # A compile error goes on to quote the grammar, here 130 kB of it.
        ({"type": "nonsense", "enum": [f"value{i}" for i in range(10_000)]}, "nonsense"),
    ],
    ids=["anyOf-2001", "self-reference", "compile-error"],
)
def test_a_grammar_llguidance_refuses_on_its_first_tokens_is_refused_when_built(schema, says):
    """These raised inside generate on the reply's first token; now building
    the processor raises GrammarError naming the field, in one short line."""
    grammars = tiny_grammars()
    with pytest.raises(GrammarError) as error:
        grammars.processor(grammars.json_schema(schema), "response_format")
    message = str(error.value)
    assert error.value.param == "response_format" and says in message, message
    assert message.startswith("response_format: ") and "\n" not in message
    assert len(message) < 400 and "value9999" not in message, message


def test_a_grammar_over_the_size_bound_is_refused_before_it_compiles():
    grammars = tiny_grammars()
    grammar = grammars.json_schema({"enum": [f"value{i}" for i in range(100_000)]})
    assert len(grammar) > grammars.max_grammar_bytes
    with pytest.raises(GrammarError) as error:
        grammars.processor(grammar, "tool_choice")
    assert error.value.param == "tool_choice" and "bytes" in str(error.value)
    assert len(str(error.value)) < 200
    small = Grammars(grammars._tokenizer, len(grammars._tokenizer), [2], max_grammar_bytes=100)
    with pytest.raises(GrammarError, match="over the 100"):
        small.processor(small.json_schema(ANSWER), "response_format")


@pytest.mark.parametrize("family", ["llama", "lfm2"])
def test_a_grammar_refused_while_decoding_ends_the_reply_as_plain_generate_does(family, caplog):
    """A refusal a few tokens in raised inside generate, so the turn failed
    and the session dropped its cache. Now the processor keeps the error and
    allows only the end: the turn commits, token for token what plain
    generate writes with the same processor (float64), the error names the
    field, the log says it in one line without the grammar, and the next
    turn reuses the cache."""
    from helpers import SYSTEM, model_for, reference_turn
    from kvchat import SessionManager
    from kvchat.prompting import end_ids

    model, tokenizer = model_for(family), tiny_tokenizer()
    ends = end_ids(tokenizer, model.generation_config)
    grammars = Grammars(tokenizer, model.config.vocab_size, ends)
    grammar = grammars.json_schema(REFUSED_LATER)
    messages = [SYSTEM, {"role": "user", "content": "Hello"}]
    manager = SessionManager(model, tokenizer)
    processor = grammars.processor(grammar, "response_format")
    with caplog.at_level("WARNING", logger="kvchat.agents"):
        manager.chat("s", messages, max_new_tokens=60, logits_processor=[processor])
    logged = [r.getMessage() for r in caplog.records if r.name == "kvchat.agents"]
    report = manager.last_turn("s")
    fresh = grammars.processor(grammar, "response_format")
    expected = reference_turn(model, tokenizer, messages, 60, logits_processor=[fresh])[2]
    assert report.output_ids == expected and fresh.error is not None
    assert report.output_ids[-1] in ends and len(report.output_ids) < 20, report
    assert tokenizer.decode(report.output_ids).startswith('{"a": ')
    error = processor.error
    assert error.param == "response_format"
    assert str(error).startswith("response_format: llguidance refused its grammar while decoding")
    assert len(logged) == 1 and "Too many items" in logged[0], logged
    assert "$defs" not in logged[0] and "%json" not in logged[0] and "\n" not in logged[0]
    # The turn committed: the session holds its prompt and reply, not a dropped cache.
    assert manager.info("s").cached_tokens >= report.prompt_tokens
    if family == "llama":  # attention crops back to the prompt (a hybrid keeps no state there)
        manager.chat("s", messages, max_new_tokens=4)
        assert manager.last_turn("s").reused_tokens >= report.prompt_tokens - 1


def _forced_loop(
    template: str | None,
    model,
    turns: int = 2,
    exact=range(2),
    min_reuse: float = 0.9,
    max_new_tokens: int = 200,
) -> None:
    """A tool loop whose every turn is forced to call a tool, through
    SessionManager: each turn in ``exact`` is token for token plain generate
    with the same grammar, every reply is read back as an allowed call, and
    the call (sent back with JSON text arguments, as clients do) and its
    result start the next turn, which reuses the cache."""
    from helpers import SYSTEM, common_prefix, history_ids, reference_turn
    from kvchat import SessionManager
    from kvchat.agents import detect
    from kvchat.prompting import end_ids, render_prompt, render_text
    from llama_cpp_models import template_text

    if template is None:
        tokenizer = tiny_tokenizer()
    else:
        tokenizer = tiny_tokenizer(chat_template=template_text(template))
    fmt = detect(tokenizer)
    ends = end_ids(tokenizer, model.generation_config)
    grammars = Grammars(tokenizer, model.config.vocab_size, ends)
    grammar = grammars.tool_calls(fmt, TOOLS, parallel=False)
    messages = [SYSTEM, {"role": "user", "content": "The weather in Paris?"}]
    manager = SessionManager(model, tokenizer)
    for turn in range(turns):
        processor = grammars.processor(grammar, "tool_choice")
        manager.chat(
            "s", messages, max_new_tokens=max_new_tokens, tools=TOOLS, logits_processor=[processor]
        )
        report = manager.last_turn("s")
        if turn in exact:
            fresh = grammars.processor(grammar, "tool_choice")
            _, _, expected = reference_turn(
                model, tokenizer, messages, max_new_tokens, tools=TOOLS, logits_processor=[fresh]
            )
            assert report.output_ids == expected, f"turn {turn}"
        if turn > 0:  # settled on the call as it is sent back: only the result is new
            prompt = render_prompt(tokenizer, messages, tools=TOOLS)
            held = common_prefix(history_ids(tokenizer, messages[:-1], TOOLS), prompt)
            assert report.reused_tokens >= min(held, prompt.numel() - 1), (report, held)
            assert report.reused_tokens >= min_reuse * report.prompt_tokens, report
        text = tokenizer.decode(list(report.output_ids), skip_special_tokens=False)
        _, calls = _read(fmt, text.split(tokenizer.eos_token)[0])
        assert len(calls) == 1 and _allowed(calls[0]), text
        before = render_text(tokenizer, messages, tools=TOOLS)
        messages.append({"role": "assistant", "content": "", "tool_calls": [calls[0].as_dict()]})
        # The tool's time: the session settles on the call as it is sent back.
        manager.settle("s", messages, tools=TOOLS)
        assert manager.wait_settled(timeout=120)
        messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"})
        # The call sent back shows in what the model reads next (SmolLM3's
        # template renders none: kvchat writes it into the content).
        after = render_text(tokenizer, messages, tools=TOOLS)
        assert after.count(calls[0].name) > before.count(calls[0].name), after


@pytest.mark.parametrize(
    "template",
    [
        "Qwen3.5-4B",
        "GLM-4.6",
        "MiniMax-M2",
        "LFM2.5-8B-A1B",
        "openai-gpt-oss-120b",
        "deepseek-ai-DeepSeek-V3.1",
        "deepseek-ai-DeepSeek-V3.2",
        "deepseek-ai-DeepSeek-V4",
        "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B",
        "ByteDance-Seed-OSS",
        "tencent-Hy3",
        "Cohere2MoE",
        "NVIDIA-Nemotron-Nano-v2",
        "GigaChat3.1-10B-A1.8B",
        "MiniMax-M1",
        "SmolLM3-3B-xml_tools",  # llama_cpp_models.SMOLLM3
    ],
)
def test_a_forced_call_on_a_real_template_is_plain_generates_and_reads_back(template):
    """Forced calls on real templates' markup, with the tiny float64 model:
    every turn plain generate's, every call read back, and the next turn
    reusing everything before the tool's result (the loop checks that
    exactly). The share that is new depends on the template: DeepSeek's
    render no tool schemas and Cohere's wraps a result in a verbose JSON
    list, and the tiny vocabulary spells their markers byte by byte, so the
    result alone is 10-16% of the prompt there."""
    from helpers import model_for

    min_reuse = 0.8 if template.startswith("deepseek") or template == "Cohere2MoE" else 0.9
    max_new_tokens = 400 if template == "tencent-Hy3" else 200  # its tags are long here
    _forced_loop(template, model_for("llama"), min_reuse=min_reuse, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize(
    "family, template",
    [
        ("llama", None),
        ("lfm2", None),
        ("lfm2", "LFM2.5-8B-A1B"),  # Python calls, on the hybrid
        ("llama", "openai-gpt-oss-120b"),  # harmony
        ("llama", "SmolLM3-3B-xml_tools"),  # calls sent back written into the content
    ],
)
def test_forced_calls_in_half_precision_stay_calls_and_reuse(family, template, dtype):
    """In bfloat16 and float16 a cached turn's logits round differently from
    plain generate's (test_bfloat16.py), so only the first turn, with nothing
    to reuse, is token for token plain generate's; every turn is still a
    call the grammar allows, read back, and every later turn reuses its
    settled history."""
    from kvchat.tiny import tiny_model

    _forced_loop(template, tiny_model(family, dtype=dtype, seed=0), turns=3, exact=range(1))


def _accepts(grammars: Grammars, grammar: str, text: str) -> bool:
    matcher = grammars.processor(grammar, "x")._matcher
    ids = grammars._tokenizer(text, add_special_tokens=False)["input_ids"]
    return matcher.validate_tokens(ids) == len(ids) and (
        matcher.consume_tokens(ids) and matcher.is_accepting()
    )


def _one(props: dict) -> list[dict]:
    parameters = {"type": "object", "properties": props, "required": list(props)}
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def test_xml_values_are_written_as_the_parser_reads_them_back():
    """What the grammar lets a model write in the XML formats is what the
    parser reads back: a value that may be a string (pydantic's Optional[str],
    no type) as bare text, not JSON it would keep quoted; no text holding a
    closing tag the parser would split at; Qwen's booleans as its templates
    write them; keys the parser could not read refused by name."""
    grammars = tiny_grammars()
    optional = _one({"s": {"anyOf": [{"type": "string"}, {"type": "null"}]}})
    untyped = _one({"s": {"description": "anything"}})
    for tools in (optional, untyped):
        grammar = grammars.tool_calls(QWEN_XML, tools, parallel=False)
        text = "<tool_call>\n<function=f>\n<parameter=s>\nhello\n</parameter>\n"
        text += "</function>\n</tool_call>"
        assert _accepts(grammars, grammar, text)
        parser = ToolCallParser(QWEN_XML, tools)
        parser.feed(text)
        parser.finish()
        assert json.loads(parser.calls[0].arguments) == {"s": "hello"}
    strings = _one({"s": {"type": "string"}})
    for fmt, text in (
        (QWEN_XML, "<tool_call>\n<function=f>\n<parameter=s>\na</tool_call>b\n</parameter>\n"),
        (GLM, "<tool_call>f\n<arg_key>s</arg_key>\n<arg_value>a</tool_call>b</arg_value>\n"),
    ):
        grammar = grammars.tool_calls(fmt, strings, parallel=False)
        assert not _accepts(grammars, grammar, text + "</function>\n</tool_call>"), fmt.name
    flags = _one({"b": {"type": "boolean"}})
    grammar = grammars.tool_calls(QWEN_XML, flags, parallel=False)
    written = (
        "<tool_call>\n<function=f>\n<parameter=b>\n{}\n</parameter>\n</function>\n</tool_call>"
    )
    assert _accepts(grammars, grammar, written.format("True"))
    assert not _accepts(grammars, grammar, written.format("true"))
    with pytest.raises(GrammarError, match="'a>b'"):
        grammars.tool_calls(QWEN_XML, _one({"a>b": {"type": "integer"}}))


def test_a_name_the_markup_cannot_hold_is_refused_not_written_unreadable():
    """MiniMax reads a name or key up to a quote, the other formats that
    write the name bare up to a space, '<', '[' or ':': forcing a call to
    such a tool is a 400 naming it, never a call that comes back as text."""
    grammars = tiny_grammars()
    quoted = _one({"a": {"type": "integer"}})
    quoted[0]["function"]["name"] = 'q"n'
    for fmt in (MINIMAX, QWEN_XML, GLM, KIMI, DEEPSEEK_V31, MISTRAL_V11, HARMONY):
        with pytest.raises(GrammarError, match='q"n'):
            grammars.tool_calls(fmt, quoted, parallel=False)
    with pytest.raises(GrammarError, match='a"b'):
        grammars.tool_calls(MINIMAX, _one({'a"b': {"type": "integer"}}), parallel=False)
    grammars.tool_calls(HERMES, quoted, parallel=False)  # a JSON string holds it


def _lfm2_template_tokenizer():
    from llama_cpp_models import fetch

    template = (fetch() / "templates" / "LFM2.5-8B-A1B.jinja").read_text()
    return tiny_tokenizer(chat_template=template)


def test_python_call_arguments_are_written_as_the_template_renders_them_back():
    """LFM2's calls are Python (``name(key=VALUE)``): what the grammar lets a
    model write reads back typed by the schema, within the numbers the parser
    reads (it refuses an integer literal past 2**53 - 1, which JSON for a
    number or a nested integer may write), and is the text LFM2.5's template
    renders when the call is sent back, so the next turn's prompt starts
    with the reply as it was cached."""
    grammars, tokenizer = tiny_grammars(), _lfm2_template_tokenizer()
    grammar = grammars.tool_calls(LFM2, [BOOKING], parallel=False)
    notes, cities, same = set(), set(), 0
    for seed in range(16):
        text = walk(grammars, grammar, seed, close="'")
        parser = ToolCallParser(LFM2, [BOOKING])
        parser.feed(text)
        parser.finish()
        assert parser.content == "" and len(parser.calls) == 1, text
        arguments = json.loads(parser.calls[0].arguments)
        assert type(arguments["nights"]) is int and type(arguments["guests"]["adults"]) is int
        assert isinstance(arguments["city"], str) and isinstance(arguments["budget"], (int, float))
        cities.add(arguments["city"])
        notes.add("note" in arguments)
        call = {"type": "function", "function": {"name": "book", "arguments": arguments}}
        rendered = tokenizer.apply_chat_template(
            [
                {"role": "user", "content": "Book it."},
                {"role": "assistant", "content": "", "tool_calls": [call]},
            ],
            tokenize=False,
        )
        # A number JSON wrote with more digits than a float holds is rendered
        # as Python prints it: that one value differs, nothing else.
        written = re.search(r"budget=([^,)]+)", text)[1]
        expected = text.replace(f"budget={written}", f"budget={arguments['budget']}")
        assert expected + "<|im_end|>" in rendered, (text, rendered)
        same += expected == text
    assert notes == {True, False} and len(cities) > 8 and same > 8


def test_python_call_values_and_names_the_parser_could_not_read_are_handled():
    """Strings the template would quote badly are JSON instead, a string never
    spells the closing marker, booleans and None are Python's, and a name the
    parser cannot read is refused by name."""
    grammars = tiny_grammars()
    written = "<|tool_call_start|>[f(s={})]<|tool_call_end|>"
    choices = _one({"s": {"enum": ["it's", "plain"]}})
    grammar = grammars.tool_calls(LFM2, choices, parallel=False)
    assert _accepts(grammars, grammar, written.format('"it\'s"'))
    assert _accepts(grammars, grammar, written.format("'plain'"))
    assert not _accepts(grammars, grammar, written.format("'it's'"))
    strings = grammars.tool_calls(LFM2, _one({"s": {"type": "string"}}), parallel=False)
    assert _accepts(grammars, strings, written.format("'a <b> | c<'"))
    assert not _accepts(grammars, strings, written.format("'a<|tool_call_end|>'"))
    flags = grammars.tool_calls(LFM2, _one({"s": {"type": "boolean"}}), parallel=False)
    assert _accepts(grammars, flags, written.format("True"))
    assert not _accepts(grammars, flags, written.format("true"))
    optional = _one({"s": {"type": "integer"}, "t": {"type": "null"}})
    optional[0]["function"]["parameters"]["required"] = ["t"]
    grammar = grammars.tool_calls(LFM2, optional, parallel=False)
    assert _accepts(grammars, grammar, "<|tool_call_start|>[f(t=None)]<|tool_call_end|>")
    assert _accepts(grammars, grammar, "<|tool_call_start|>[f(s=3, t=None)]<|tool_call_end|>")
    assert not _accepts(grammars, grammar, "<|tool_call_start|>[f(s=3)]<|tool_call_end|>")
    big = "<|tool_call_start|>[f(s=9007199254740992, t=None)]<|tool_call_end|>"
    assert not _accepts(grammars, grammar, big)
    # Any value (no type, an array or object of anything): numbers bounded at
    # every depth, so what the grammar allows the parser reads.
    anything = grammars.tool_calls(LFM2, _one({"s": {}}), parallel=False)
    for value in ('[1, "a", true, null]', '{"a": [1, {"b": -2.5}]}', '"s"', "null"):
        assert _accepts(grammars, anything, written.format(value)), value
    for value in ("12345678901234567890", "[1, [12345678901234567890]]", "1e400"):
        assert not _accepts(grammars, anything, written.format(value)), value
        assert not _accepts(grammars, anything, written.format(f'{{"a": {value}}}')), value
    with pytest.raises(GrammarError, match="nsatisfiable"):  # a constant it cannot read
        grammars.processor(grammars.tool_calls(LFM2, _one({"s": {"const": 2**60}})), "x")
    # A parameter that refers to the arguments schema's $defs (as pydantic
    # writes): written as what it refers to is (a boolean as True or False).
    referring = _one({"s": {"$ref": "#/$defs/P"}})
    referring[0]["function"]["parameters"]["$defs"] = {"P": {"type": "boolean"}}
    grammar = grammars.tool_calls(LFM2, referring, parallel=False)
    assert _accepts(grammars, grammar, written.format("True"))
    assert not _accepts(grammars, grammar, written.format("1"))
    with pytest.raises(GrammarError, match="'1st'") as error:
        grammars.tool_calls(LFM2, _one({"1st": {"type": "integer"}}))
    assert error.value.param == "tool_choice"
    renamed = _one({"s": {"type": "integer"}})
    renamed[0]["function"]["name"] = "2fast"
    with pytest.raises(GrammarError, match="'2fast'"):
        grammars.tool_calls(LFM2, renamed)


# ------------------------------------------------- forced calls that end (issue 47)
# As LangChain's bind_tools on a Python function and smolagents write
# parameters: no additionalProperties, and a key with a default not required.
LOOSE = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "unit": {"description": "Which unit.", "enum": ["c", "f"]},
                "hourly": {"type": "boolean"},
                "where": {
                    "type": "object",
                    "properties": {"coast": {"type": "boolean"}},
                    "required": ["coast"],
                },
            },
            "required": ["unit"],
        },
    },
}
# pydantic's nested model: the parameters refer to their own $defs.
PLACE = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {"place": {"$ref": "#/$defs/Place"}, "zone": {"$ref": "#/$defs/Zone"}},
            "required": ["place", "zone"],
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {"coast": {"type": "boolean"}, "zone": {"$ref": "#/$defs/Zone"}},
                    "required": ["coast", "zone"],
                },
                "Zone": {"enum": ["north", "south"], "type": "string"},
            },
        },
    },
}


def _walked_calls(fmt, tools, seeds=8, limit=2000):
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(fmt, tools, parallel=False)
    out = []
    for seed in range(seeds):
        text = walk(grammars, grammar, seed, limit=limit)
        parser = ToolCallParser(fmt, tools)
        parser.feed(text)
        parser.finish()
        assert parser.content.strip() == "" and len(parser.calls) == 1, text
        out.append((text, json.loads(parser.calls[0].arguments)))
    return out


@pytest.mark.parametrize("fmt", CONSTRAINABLE, ids=lambda f: f.name)
def test_parameters_that_leave_additional_properties_unsaid_allow_no_other_key(fmt):
    """Unsaid additionalProperties means no other key (xgrammar's strict
    default), at every depth: every walk ends within its limit and writes
    only the declared keys (a free key's name was a string that a random
    walk never closed)."""
    keys = set(LOOSE["function"]["parameters"]["properties"])
    for text, arguments in _walked_calls(fmt, [LOOSE]):
        assert "unit" in arguments and set(arguments) <= keys, text
        assert set(arguments.get("where", {"coast": 1})) == {"coast"}, text


def test_an_explicit_true_keeps_other_keys():
    grammars = tiny_grammars()
    tools = _one({"a": {"type": "boolean"}})
    open_ = json.loads(json.dumps(tools))
    open_[0]["function"]["parameters"]["additionalProperties"] = True
    call = '<tool_call>\n{"name": "f", "arguments": {"a": true, "b": 1}}\n</tool_call>'
    assert not _accepts(grammars, grammars.tool_calls(HERMES, tools, parallel=False), call)
    assert _accepts(grammars, grammars.tool_calls(HERMES, open_, parallel=False), call)


@pytest.mark.parametrize("fmt", CONSTRAINABLE, ids=lambda f: f.name)
def test_parameters_that_refer_to_their_defs_are_constrained_on_every_markup(fmt):
    """$ref into the parameters' own $defs (pydantic's nested models), on the
    JSON markups (where the parameters sit inside the calls' schema), the XML
    ones and LFM2's Python calls: every walk is a call whose values are what
    the definitions allow."""
    for text, arguments in _walked_calls(fmt, [PLACE]):
        assert set(arguments) == {"place", "zone"}, text
        assert arguments["zone"] in ("north", "south"), text
        place = arguments["place"]
        assert set(place) == {"coast", "zone"} and place["zone"] in ("north", "south"), text
        assert isinstance(place["coast"], bool), text


MARKED = _one({"x</tool_call>y": {"enum": ["a</tool_call>b", "[TOOL_CALLS]<|tool_call_end|>"]}})
JSON_MARKUPS = [f for f in CONSTRAINABLE if f.grammar.xml is None and f is not HARMONY]


@pytest.mark.parametrize("fmt", JSON_MARKUPS, ids=lambda f: f.name)
def test_markup_inside_a_calls_strings_is_read_as_the_strings_it_is(fmt):
    """An enum value and a key that hold closing markup (Hermes', Mistral's,
    LFM2's): the parser reads the JSON (or Python) strings as strings, so
    the call is read whole with those texts (it was cut at the marker and
    came back as text)."""
    key = "s" if fmt is LFM2 else "x</tool_call>y"  # LFM2's keys are Python names
    tools = _one({key: MARKED[0]["function"]["parameters"]["properties"]["x</tool_call>y"]})
    for text, arguments in _walked_calls(fmt, tools, seeds=4):
        assert set(arguments) == {key}, text
        assert arguments[key] in ("a</tool_call>b", "[TOOL_CALLS]<|tool_call_end|>"), text


@pytest.mark.parametrize("fmt", CONSTRAINABLE, ids=lambda f: f.name)
def test_a_text_holding_a_special_token_is_refused_by_name(fmt):
    """llguidance writes a special token's text as that token, so an enum
    value or key holding the end token would end the reply inside the call:
    refused, naming the tool, the place and the text."""
    grammars = tiny_grammars()
    for props, where in (
        ({"s": {"enum": ["a<|im_end|>"]}}, "enum"),
        ({"k<|im_end|>": {"type": "boolean"}}, "properties"),
        ({"s": {"type": "object", "properties": {"n": {"const": "<|im_end|>"}}}}, "const"),
    ):
        with pytest.raises(GrammarError, match=r"'f'.*" + where + r".*<\|im_end\|>") as error:
            grammars.tool_calls(fmt, _one(props), parallel=False)
        assert error.value.param == "tool_choice"


def test_a_required_key_holding_a_special_token_is_refused_too():
    """A key only ``required`` names (under additionalProperties) is written
    as it is given too: it passed the check and the reply ended inside it."""
    parameters = {"properties": {}, "required": ["<|im_end|>"], "additionalProperties": True}
    tool = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(GrammarError, match=r"'f'.*required.*<\|im_end\|>") as error:
        tiny_grammars().tool_calls(HERMES, tool, parallel=False)
    assert error.value.param == "tool_choice"


def test_a_response_format_holding_a_special_token_is_refused_by_name():
    """Beside tools ("auto" and a JSON response_format) such a const came back
    as broken JSON; alone, as llguidance's cryptic refusal."""
    grammars = tiny_grammars()
    for schema in ({"const": "<|im_end|>"}, {"type": "object", "properties": {"a<|im_end|>": {}}}):
        with pytest.raises(GrammarError, match=r"response_format.*<\|im_end\|>") as error:
            grammars.json_schema(schema)
        assert error.value.param == "response_format"
        with pytest.raises(GrammarError, match=r"<\|im_end\|>") as error:
            grammars.tool_calls(HERMES, TOOLS, parallel=False, or_json=schema)
        assert error.value.param == "response_format"


def test_a_ref_inside_a_const_value_is_data_and_written_as_declared():
    """A const object that holds "$ref" is a value, not a reference: moving the
    parameters under the grammar's $defs rewrote it, so the call's arguments
    were not the declared constant."""
    value = {"$ref": "#/keep/me"}
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(HERMES, _one({"v": {"const": value}}), parallel=False)
    text = walk(grammars, grammar, 0, limit=4000)
    parser = ToolCallParser(HERMES, _one({"v": {"const": value}}))
    parser.feed(text)
    parser.finish()
    (call,) = parser.calls
    assert json.loads(call.arguments) == {"v": value}


@pytest.mark.parametrize(
    "fmt", [QWEN_XML, GLM, MINIMAX, SEED_OSS, HY3, DEEPSEEK_V32], ids=lambda f: f.name
)
def test_an_xml_markup_refuses_a_text_with_a_closing_tag(fmt):
    """The XML parsers split a call at the first "</": an enum value holding
    one cannot be carried, and is refused by name rather than written."""
    with pytest.raises(GrammarError, match=r"'f'.*enum.*'a</b'") as error:
        tiny_grammars().tool_calls(fmt, _one({"s": {"enum": ["a</b", "c"]}}), parallel=False)
    assert error.value.param == "tool_choice"


@pytest.mark.parametrize("fmt", CONSTRAINABLE, ids=lambda f: f.name)
def test_parallel_calls_may_end_after_any_complete_call(fmt):
    """With parallel calls, the end token is allowed right after each
    complete call: one call's text (the section closed after it), and two
    calls' text, each end the reply under the parallel grammar."""
    grammars = tiny_grammars()
    parallel = grammars.tool_calls(fmt, TOOLS, parallel=True)
    one = walk(grammars, grammars.tool_calls(fmt, TOOLS, parallel=False), 0, limit=4000)
    assert _accepts(grammars, parallel, one), one
    g = fmt.grammar
    if g.separator is None:
        return
    # Two calls: the first's text, the separator, and the second's call text.
    body = one[len(g.section_open) : len(one) - len(g.section_close)]
    two = g.section_open + body + g.separator + body + g.section_close
    assert _accepts(grammars, parallel, two), two


@pytest.mark.parametrize(
    "family, template", [("llama", None), ("lfm2", None), ("lfm2", "LFM2.5-8B-A1B")]
)
def test_forced_calls_of_loose_and_referring_tools_are_plain_generates(family, template):
    """A forced turn on the tiny float64 model, for the no-additionalProperties
    tool and the $defs tool: token for token plain generate with the same
    grammar, on an attention model and the LFM2 hybrid (Hermes' JSON calls,
    and LFM2.5's Python ones), and read back as a call that ends."""
    from helpers import SYSTEM, model_for, reference_turn
    from kvchat import SessionManager
    from kvchat.agents import detect
    from kvchat.prompting import end_ids
    from llama_cpp_models import template_text

    model = model_for(family)
    tokenizer = tiny_tokenizer(template_text(template)) if template else tiny_tokenizer()
    fmt = detect(tokenizer)
    grammars = Grammars(
        tokenizer, model.config.vocab_size, end_ids(tokenizer, model.generation_config)
    )
    manager = SessionManager(model, tokenizer)
    for i, tools in enumerate(([LOOSE], [PLACE], [LOOSE, PLACE])):
        grammar = grammars.tool_calls(fmt, tools, parallel=False)
        messages = [SYSTEM, {"role": "user", "content": "The weather in Paris?"}]
        processor = grammars.processor(grammar, "tool_choice")
        manager.chat(
            f"s{i}", messages, max_new_tokens=160, tools=tools, logits_processor=[processor]
        )
        report = manager.last_turn(f"s{i}")
        fresh = grammars.processor(grammar, "tool_choice")
        expected = reference_turn(
            model, tokenizer, messages, 160, tools=tools, logits_processor=[fresh]
        )[2]
        assert report.output_ids == expected
        text = tokenizer.decode(list(report.output_ids), skip_special_tokens=False)
        assert text.endswith(tokenizer.eos_token), text
        parser = ToolCallParser(fmt, tools)
        parser.feed(text.split(tokenizer.eos_token)[0])
        parser.finish()
        assert len(parser.calls) == 1, text


# JSON-valued XML parameters (an object, an array) whose strings a model may
# fill with anything: the template's closing tag included.
NESTED = _one(
    {
        "o": {
            "type": "object",
            "properties": {
                "s": {"type": "string", "maxLength": 16},  # a random walk ends it
                "t": {"type": ["string", "null"], "maxLength": 16},
            },
            "required": ["s"],
        },
        "l": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 2},
    }
)


@pytest.mark.parametrize(
    "fmt", [QWEN_XML, GLM, MINIMAX, SEED_OSS, HY3, DEEPSEEK_V32], ids=lambda f: f.name
)
def test_an_xml_json_value_never_holds_a_closing_tag(fmt):
    """The XML parsers split a call at the first "</", also inside a
    parameter written as JSON: walks that write "</tool_call>" (and the
    format's own closing tags) wherever the grammar allows it always read
    back as one call, whose strings hold no "</" (they came back as text)."""
    grammars = tiny_grammars()
    grammar = grammars.tool_calls(fmt, NESTED, parallel=False)
    for seed in range(6):
        text = walk(grammars, grammar, seed, limit=3000, close="</tool_call>")
        parser = ToolCallParser(fmt, NESTED)
        parser.feed(text)
        parser.finish()
        assert parser.content.strip() == "" and len(parser.calls) == 1, text
        arguments = json.loads(parser.calls[0].arguments)
        assert isinstance(arguments["o"]["s"], str) and "</" not in json.dumps(arguments), text


def test_free_keys_and_values_in_an_xml_json_value_hold_no_closing_tag():
    """Keys an object leaves free (a dict parameter, additionalProperties
    true or a schema, or any value) and strings with their own pattern get
    no "</" either; what cannot be so kept (patternProperties) is refused by
    name, not written unreadable."""
    grammars = tiny_grammars()
    written = (
        "<tool_call>\n<function=f>\n<parameter=d>\n{}\n</parameter>\n</function>\n</tool_call>"
    )
    for schema in (
        {"type": "object", "additionalProperties": True},
        {"type": "object", "additionalProperties": {"type": "string"}},
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True},
        {"type": "array", "items": {"type": "string", "pattern": "^a"}},
    ):
        grammar = grammars.tool_calls(QWEN_XML, _one({"d": schema}), parallel=False)
        if schema["type"] == "array":
            assert _accepts(grammars, grammar, written.format('["a<b"]'))
            assert not _accepts(grammars, grammar, written.format('["b"]'))
            assert not _accepts(grammars, grammar, written.format('["a</tool_call>"]'))
            continue
        assert _accepts(grammars, grammar, written.format('{"a": "x<y"}')), schema
        assert not _accepts(grammars, grammar, written.format('{"a</tool_call>": "x"}')), schema
        assert not _accepts(grammars, grammar, written.format('{"a": "x</tool_call>"}')), schema
    with pytest.raises(GrammarError, match=r"'d' of 'f'.*patternProperties") as error:
        pattern = {"type": "object", "patternProperties": {"^x": {"type": "string"}}}
        grammars.tool_calls(QWEN_XML, _one({"d": pattern}), parallel=False)
    assert error.value.param == "tool_choice"


# "a, and either b or c": branches that add properties to their parent's.
EITHER = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "anyOf": [
        {"properties": {"b": {"type": "string", "maxLength": 8}}, "required": ["b"]},
        {"properties": {"c": {"type": "string", "maxLength": 8}}, "required": ["c"]},
    ],
}


@pytest.mark.parametrize("branches", ["anyOf", "oneOf"])
def test_branches_that_add_properties_keep_their_parents_and_no_other(branches):
    """An object with properties of its own and anyOf/oneOf branches that
    add more describes one object: strict closing keeps the parent's keys in
    each branch and the branches' keys in the parent (each branch was closed
    on its own keys, so no object met both: a 400 "Unsatisfiable schema"),
    and still no key that none names."""
    schema = json.loads(json.dumps(EITHER).replace('"anyOf"', json.dumps(branches)))
    grammars = tiny_grammars()
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    grammar = grammars.tool_calls(HERMES, tools, parallel=False)
    for arguments, allowed in (
        ({"a": 1, "b": "x"}, True),
        ({"a": 1, "c": "y"}, True),
        ({"a": 1}, False),
        ({"a": 1, "b": "x", "z": 1}, False),
        ({"z": 1, "a": 1, "b": "x"}, False),
    ):
        call = json.dumps({"name": "f", "arguments": arguments})
        assert _accepts(grammars, grammar, f"<tool_call>\n{call}\n</tool_call>") == allowed, call
    # In the XML formats an untyped branch reads as "may be a string" (the
    # value is then text), so there the branches say they are objects.
    typed = {**schema, branches: [{**b, "type": "object"} for b in schema[branches]]}
    for fmt, walked in ((HERMES, tools), (QWEN_XML, _one({"o": typed}))):
        for text, arguments in _walked_calls(fmt, walked, seeds=6):
            value = arguments if fmt is HERMES else arguments["o"]
            assert set(value) in ({"a", "b"}, {"a", "c"}), text


@pytest.mark.parametrize("fmt", [HERMES, QWEN_XML], ids=lambda f: f.name)
def test_an_untyped_object_parameter_is_empty_unless_it_says_true(fmt):
    """A Python dict parameter ({"type": "object"}, no properties) can only
    be {} under a grammar, as docs/agents.md says; with
    additionalProperties true it takes keys."""
    grammars = tiny_grammars()
    closed = _one({"d": {"type": "object"}})
    open_ = _one({"d": {"type": "object", "additionalProperties": True}})
    if fmt is HERMES:
        text = '<tool_call>\n{{"name": "f", "arguments": {{"d": {}}}}}\n</tool_call>'
    else:
        text = "<tool_call>\n<function=f>\n<parameter=d>\n{}\n</parameter>\n</function>\n"
        text += "</tool_call>"
    for tools, keyed in ((closed, False), (open_, True)):
        grammar = grammars.tool_calls(fmt, tools, parallel=False)
        assert _accepts(grammars, grammar, text.format("{}"))
        assert _accepts(grammars, grammar, text.format('{"k": 1}')) == keyed
