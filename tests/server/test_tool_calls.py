"""Tool calls and output constraints as pure Python: no server, no model.

``cadence/server/tool_calls.py``: the Hermes ``<tool_call>`` parser (whole
text and streamed, which must agree: a hypothesis property over random
texts and split points), the ``"required"`` array parser, the named-call
parser, the streamed OpenAI deltas, the request checks, the forced-call
grammar and the conversation rewritten for a template without tools.
``cadence/server/constraints.py``: the request fields that constrain the
output, and the error messages that name the field the request used.
"""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cadence.sampling_params import StructuredOutputParams
from cadence.server.constraints import from_response_format, rename_field, requested_constraint
from cadence.server.protocol import ResponseFormat
from cadence.server.tool_calls import (
    CALL_CLOSE, CALL_OPEN, CallArrayParser, HermesParser, NamedCallParser, ToolCallDeltas, check_tools,
    forced_call_constraint, parse_all, prepare_conversation, tool_calls_finish, tools_system_prompt,
)

WEATHER = {"name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}
SEARCH = {"name": "search", "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": SEARCH}]
NO_TOOLS_TEMPLATE = "{{ messages }}"
TOOLS_TEMPLATE = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages }}"


def block(body: str) -> str:
    return f"{CALL_OPEN}{body}{CALL_CLOSE}"


def call_text(name: str, arguments: dict, key: str = "arguments") -> str:
    return block(json.dumps({"name": name, key: arguments}))


def name_args(calls) -> list[tuple[str, object]]:
    """(name, decoded arguments) of each call: ids differ between parses."""
    return [(call.name, json.loads(call.arguments)) for call in calls]


def stream(parser, pieces: list[str]) -> tuple[list[str], list]:
    """(the content emitted after each feed and after finish(), the calls) of ``pieces`` fed in turn."""
    contents, calls = [], []
    for parsed in [parser.feed(piece) for piece in pieces] + [parser.finish()]:
        contents.append(parsed.content)
        calls += parsed.calls
    return contents, calls


def split(text: str, cuts) -> list[str]:
    bounds = [0, *sorted(set(cuts)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


# ---------------------------------------------------------------- HermesParser, whole text


def test_hermes_content_around_and_between_calls():
    text = ("Let me check. " + call_text("get_weather", {"city": "Paris"}) + " and then "
            + call_text("search", {"q": "rain", "n": [1, {"deep": None}]}) + " Done.")
    content, calls = parse_all(HermesParser(), text)
    assert content == "Let me check.  and then  Done."
    assert name_args(calls) == [("get_weather", {"city": "Paris"}),
                                ("search", {"q": "rain", "n": [1, {"deep": None}]})]
    assert all(call.id.startswith("call_") for call in calls)
    assert calls[0].id != calls[1].id


def test_hermes_arguments_are_json_text():
    body = '\n{"name": "f", "arguments": {"a": 1,   "b": "é<>"}}\n'
    content, calls = parse_all(HermesParser(), block(body))
    assert content is None
    assert isinstance(calls[0].arguments, str)
    assert json.loads(calls[0].arguments) == {"a": 1, "b": "é<>"}
    assert calls[0].arguments == '{"a": 1, "b": "é<>"}'  # re-serialised, not ASCII-escaped
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "f", "arguments": calls[0].arguments}}


def test_hermes_parameters_in_place_of_arguments_and_missing_arguments():
    text = call_text("f", {"x": 2}, key="parameters") + block('{"name": "g"}')
    _, calls = parse_all(HermesParser(), text)
    assert name_args(calls) == [("f", {"x": 2}), ("g", {})]


@pytest.mark.parametrize("body", [
    "not json", '{"name": 3, "arguments": {}}', '{"arguments": {}}', '["f", {}]', '"f"', "",
    '{"name": "f", "arguments": {}',
])
def test_hermes_block_that_is_not_a_call_stays_content_verbatim(body):
    text = "before " + block(body) + " after"
    assert parse_all(HermesParser(), text) == (text, [])


def test_hermes_not_a_call_beside_a_call():
    bad = block("oops")
    content, calls = parse_all(HermesParser(), bad + "\n" + call_text("f", {}))
    assert content == bad + "\n"
    assert name_args(calls) == [("f", {})]


def test_hermes_unclosed_block_at_the_end_is_a_call_if_its_json_is_one():
    content, calls = parse_all(HermesParser(), 'Sure. <tool_call>\n{"name": "f", "arguments": {"a": 1}}\n')
    assert content == "Sure. "
    assert name_args(calls) == [("f", {"a": 1})]


def test_hermes_unclosed_block_at_the_end_that_is_not_a_call_is_content():
    content, calls = parse_all(HermesParser(), 'Sure. <tool_call>{"name": "f", "argu')
    assert calls == []
    assert content.startswith('Sure. <tool_call>{"name": "f", "argu')


def test_hermes_unclosed_block_that_is_not_a_call_is_content_verbatim():
    text = 'Sure. <tool_call>{"name": "f", "argu'
    assert parse_all(HermesParser(), text) == (text, [])


@pytest.mark.parametrize("text", [
    call_text("f", {}), "  \n" + call_text("f", {}) + "\n\n" + call_text("g", {}) + "\n ",
])
def test_hermes_content_is_none_when_only_whitespace_surrounds_the_calls(text):
    content, calls = parse_all(HermesParser(), text)
    assert content is None
    assert [call.name for call in calls] == ["f", "g"][:len(calls)]


@pytest.mark.parametrize("text", ["", "  ", "just text", "a < b <tool <tool_call", "</tool_call> x"])
def test_hermes_text_without_calls_is_all_content(text):
    assert parse_all(HermesParser(), text) == (text, [])


# ---------------------------------------------------------------- HermesParser, streamed


# Content made of pieces that look like the start of a tag but are not one.
CONTENT_PIECES = ["a", "Hi", " ", "\n", "<", ">", "/", "<tool", "<tool_", "<tool_call", "<tool>",
                  "tool_call>", "</tool_call>", "</tool", "<tool_call/>", "{", '"', "é"]
ARGUMENT_TEXT = st.text(alphabet='ab <>/{}[]"\\\n:,é', max_size=8)
ARGUMENTS = st.dictionaries(st.sampled_from(["city", "q", "n"]),
                            st.one_of(st.integers(-9, 9), st.booleans(), st.none(), ARGUMENT_TEXT,
                                      st.lists(ARGUMENT_TEXT, max_size=2)), max_size=3)
NOT_A_CALL = ["not json", '{"name": 3}', "[1, 2]", '{"arguments": {}}', "", '"f"', '{"name": "x"']


@st.composite
def contents(draw) -> str:
    text = "".join(draw(st.lists(st.sampled_from(CONTENT_PIECES), max_size=5)))
    return text.replace(CALL_OPEN, "<tool-call>")  # never a whole opening tag


@st.composite
def hermes_texts(draw) -> tuple[str, str, list[tuple[str, object]]]:
    """(the text, its content, its calls): content pieces between calls and
    blocks that are not calls, maybe ending in an unclosed call."""
    text = content = draw(contents())
    calls = []
    for _ in range(draw(st.integers(0, 3))):
        if draw(st.booleans()):
            name, arguments = draw(st.sampled_from(["get_weather", "search"])), draw(ARGUMENTS)
            key = draw(st.sampled_from(["arguments", "parameters"]))
            pad = draw(st.sampled_from(["", "\n", " "]))
            text += block(pad + json.dumps({"name": name, key: arguments}) + pad)
            calls.append((name, arguments))
        else:
            not_a_call = block(draw(st.sampled_from(NOT_A_CALL)))  # stays content, tags included
            text, content = text + not_a_call, content + not_a_call
        piece = draw(contents())
        text, content = text + piece, content + piece
    if draw(st.booleans()):  # an unclosed call at the end
        name, arguments = "search", draw(ARGUMENTS)
        text += CALL_OPEN + "\n" + json.dumps({"name": name, "arguments": arguments})
        calls.append((name, arguments))
    return text, content, calls


def tag_cuts(data, text: str) -> list[int]:
    """Random cuts, and cuts inside some of the tags."""
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    starts = [m.start() for m in re.finditer(re.escape(CALL_OPEN), text)]
    starts += [m.start() for m in re.finditer(re.escape(CALL_CLOSE), text)]
    for start in data.draw(st.lists(st.sampled_from(starts), max_size=4)) if starts else []:
        tag_length = len(CALL_OPEN) if text.startswith(CALL_OPEN, start) else len(CALL_CLOSE)
        cuts.append(start + data.draw(st.integers(1, tag_length - 1)))
    return cuts


def expected_parse(content: str, calls: list) -> tuple[str | None, list]:
    return (None if calls and not content.strip() else content), calls


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hermes_texts(), st.data())
def test_hermes_streamed_equals_whole_text(doc, data):
    text, content, calls = doc
    whole_content, whole_calls = parse_all(HermesParser(), text)
    assert (whole_content, name_args(whole_calls)) == expected_parse(content, calls)

    emitted, streamed_calls = stream(HermesParser(), split(text, tag_cuts(data, text)))
    assert name_args(streamed_calls) == calls
    so_far = ""
    for piece in emitted:  # nothing emitted that later turns out to be part of a tag
        so_far += piece
        assert content.startswith(so_far)
    assert so_far == content


def test_hermes_fed_one_char_at_a_time():
    text = ("a < b, <tool not a tag, <tool_call oops " + call_text("f", {"s": "<tool_call>"})
            + "<tool_" + block("nope") + "</tool_call> end <")
    expected = text.replace(call_text("f", {"s": "<tool_call>"}), "")
    emitted, calls = stream(HermesParser(), list(text))
    assert "".join(emitted) == expected
    assert name_args(calls) == [("f", {"s": "<tool_call>"})]


def test_hermes_holds_back_only_what_may_start_a_tag():
    parser = HermesParser()
    assert parser.feed("Hello <tool").content == "Hello "
    assert parser.feed("box> and <").content == "<toolbox> and "
    assert parser.feed("tool_call>{\"name\": \"f\"").content == ""
    parsed = parser.feed("}</tool_call>!")
    assert (parsed.content, [call.name for call in parsed.calls]) == ("!", ["f"])


# ---------------------------------------------------------------- CallArrayParser


TRICKY_ARGS = {"x": '}{"]', "y": "back\\slash\\", "z": ["[", {"w": "\\\"}"}]}
ARRAY_TEXT = "[\n  " + json.dumps({"name": "a", "arguments": TRICKY_ARGS}) + " ,\n\t" + json.dumps(
    {"name": "b", "arguments": {}}) + "\n]"


def test_call_array_whole():
    assert name_args(stream(CallArrayParser(), [ARRAY_TEXT])[1]) == [("a", TRICKY_ARGS), ("b", {})]


def test_call_array_literal_with_escapes():
    text = r'[{"name": "a", "arguments": {"x": "}{\"]"}}, {"name": "b", "arguments": {}}]'
    assert name_args(stream(CallArrayParser(), [text])[1]) == [("a", {"x": '}{"]'}), ("b", {})]


def test_call_array_calls_appear_as_each_object_closes():
    parser = CallArrayParser()
    seen = []
    for count, char in enumerate(ARRAY_TEXT, start=1):
        seen += [(count, call.name) for call in parser.feed(char).calls]
    assert parser.finish().calls == []
    first_end = ARRAY_TEXT.index(" ,\n\t")  # right after the first object's closing brace
    second_end = ARRAY_TEXT.rindex("}") + 1
    assert seen == [(first_end, "a"), (second_end, "b")]


def test_call_array_cut_keeps_the_whole_calls_and_returns_the_rest_as_content():
    # max_tokens ended the text inside the second call: that call's text is content.
    cut = ARRAY_TEXT.index('"arguments": {}')
    emitted, calls = stream(CallArrayParser(), [ARRAY_TEXT[:cut]])
    assert name_args(calls) == [("a", TRICKY_ARGS)]
    assert emitted == ["", '{"name": "b", ']


@pytest.mark.parametrize("cut", [1, 5, ARRAY_TEXT.index('"x"') + 3])
def test_call_array_cut_inside_its_first_call_is_all_content(cut):
    text = ARRAY_TEXT[:cut]
    assert stream(CallArrayParser(), [text]) == (["", text], [])
    assert parse_all(CallArrayParser(), text) == (text, [])
    # Streamed, the same text comes out as content when the choice finishes (by length).
    deltas = ToolCallDeltas(CallArrayParser())
    content, calls = reassemble(take_all(deltas, split(text, range(0, len(text), 3))))
    assert (content, calls, deltas.num_calls) == (text, [], 0)


def test_call_array_closed_leaves_no_content():
    assert stream(CallArrayParser(), [ARRAY_TEXT + "\n"])[0][-1] == ""


# ---------------------------------------------------------------- NamedCallParser


def test_named_call_streams_one_call():
    parser = NamedCallParser("get_weather")
    first = parser.feed('{"city"')
    assert [(call.name, call.arguments) for call in first.calls] == [("get_weather", '{"city"')]
    assert first.arguments_delta == ""
    second = parser.feed(': "Paris"}')
    assert (second.calls, second.arguments_delta) == ([], ': "Paris"}')
    end = parser.finish()
    assert (end.calls, end.arguments_delta, end.content) == ([], "", "")
    assert parser.call.arguments == '{"city": "Paris"}'


def test_named_call_finish_with_nothing_fed():
    parsed = NamedCallParser("f").finish()
    assert [(call.name, call.arguments) for call in parsed.calls] == [("f", "")]


# ---------------------------------------------------------------- ToolCallDeltas


def reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """(the content, each call by index with id, name and arguments merged) of a stream."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            merged = calls.setdefault(call["index"], {"id": None, "name": None, "arguments": ""})
            function = call.get("function", {})
            merged["id"] = call.get("id", merged["id"])
            merged["name"] = function.get("name", merged["name"])
            merged["arguments"] += function.get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in range(len(calls))]


def take_all(deltas: ToolCallDeltas, pieces: list[str]) -> list[dict]:
    return [deltas.take(piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def test_deltas_without_a_parser_are_content():
    deltas = ToolCallDeltas(None)
    assert deltas.take("Hi <tool_call>", False) == {"content": "Hi <tool_call>"}
    assert deltas.take("", True) == {}
    assert deltas.num_calls == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(hermes_texts(), st.data())
def test_deltas_reassemble_to_the_whole_text_parse(doc, data):
    text = doc[0]
    whole_content, whole_calls = parse_all(HermesParser(), text)
    deltas = ToolCallDeltas(HermesParser())
    content, calls = reassemble(take_all(deltas, split(text, tag_cuts(data, text)) or [""]))
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == name_args(whole_calls)
    assert all(c["id"].startswith("call_") for c in calls)
    assert deltas.num_calls == len(whole_calls)
    # Whitespace-only content is held until text follows and dropped at the end
    # if there are calls, so the stream may lack trailing whitespace that the
    # whole-text parse keeps.
    whole_content = whole_content or ""
    assert whole_content.startswith(content)
    assert not whole_content[len(content):].strip()


def test_deltas_first_delta_of_each_call_and_indices():
    text = "Hi " + call_text("f", {"a": 1}) + call_text("g", {}) + "\n" + call_text("h", {"b": [2]})
    deltas = ToolCallDeltas(HermesParser())
    stream_deltas = take_all(deltas, list(text))
    firsts = [call for delta in stream_deltas for call in delta.get("tool_calls", [])]
    assert [call["index"] for call in firsts] == [0, 1, 2]
    for call, name in zip(firsts, "fgh"):
        assert call["type"] == "function"
        assert call["id"].startswith("call_")
        assert call["function"]["name"] == name
    assert [json.loads(call["function"]["arguments"]) for call in firsts] == [{"a": 1}, {}, {"b": [2]}]
    assert deltas.num_calls == 3
    # Whitespace after the last text is held and, with calls made, dropped.
    assert reassemble(stream_deltas)[0] == "Hi"


def test_deltas_of_calls_parted_by_whitespace_have_no_content():
    text = call_text("f", {}) + " \n" + call_text("g", {}) + " "
    for pieces in ([text], list(text), [text[:len(call_text("f", {})) + 1], text[len(call_text("f", {})) + 1:]]):
        stream_deltas = take_all(ToolCallDeltas(HermesParser()), pieces)
        assert all("content" not in delta for delta in stream_deltas)
        assert [call["name"] for call in reassemble(stream_deltas)[1]] == ["f", "g"]


def test_deltas_keep_whitespace_between_texts():
    stream_deltas = take_all(ToolCallDeltas(HermesParser()), ["Hi", " ", "\n", "there", " "])
    assert reassemble(stream_deltas)[0] == "Hi \nthere "


def test_deltas_of_a_named_call():
    deltas = ToolCallDeltas(NamedCallParser("get_weather"))
    first = deltas.take('{"ci', False)
    call = first["tool_calls"][0]
    assert (call["index"], call["type"], call["function"]) == (
        0, "function", {"name": "get_weather", "arguments": '{"ci'})
    assert "content" not in first
    assert deltas.take('ty": "Oslo"', False) == {
        "tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"'}}]}
    assert deltas.take("}", True) == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    assert deltas.num_calls == 1


def test_deltas_of_a_call_array():
    deltas = ToolCallDeltas(CallArrayParser())
    content, calls = reassemble(take_all(deltas, split(ARRAY_TEXT, range(0, len(ARRAY_TEXT), 7))))
    assert content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("a", TRICKY_ARGS), ("b", {})]
    assert deltas.num_calls == 2


@pytest.mark.parametrize("reason, expected", [("stop", "tool_calls"), ("length", "length"), (None, None)])
def test_tool_calls_finish(reason, expected):
    assert tool_calls_finish(reason) == expected


# ---------------------------------------------------------------- check_tools


@pytest.mark.parametrize("tools, tool_choice, field", [
    (["get_weather"], None, "tools.0:"),
    ([{"type": "function"}], None, "tools.0:"),
    ([{"type": "code", "function": WEATHER}], None, "tools.0:"),
    ([{"type": "function", "function": [WEATHER]}], None, "tools.0:"),
    ([TOOLS[0], {"type": "function", "function": {"description": "no name"}}], None, "tools.1.function.name:"),
    ([TOOLS[0], {"type": "function", "function": {"name": ""}}], None, "tools.1.function.name:"),
    ([{"type": "function", "function": {"name": 7}}], None, "tools.0.function.name:"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None,
     "tools.0.function.parameters:"),
    ([{"type": "function", "function": {"name": "f", "parameters": None}}], None,
     "tools.0.function.parameters:"),
    (None, "required", "tool_choice:"),
    ([], "auto", "tool_choice:"),
    (TOOLS, "always", "tool_choice:"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice:"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, "tool_choice:"),
    (TOOLS, {"type": "function", "function": ["get_weather"]}, "tool_choice:"),
    (TOOLS, {"type": "function", "function": {"name": 3}}, "tool_choice:"),
    (TOOLS, {"function": {"name": "get_weather"}}, "tool_choice:"),
])
def test_check_tools_errors_name_the_field(tools, tool_choice, field):
    with pytest.raises(ValueError) as err:
        check_tools(tools, tool_choice)
    assert str(err.value).startswith(field)


def test_check_tools_defaults():
    assert check_tools(None, None) == ([], "none")
    assert check_tools([], "none") == ([], "none")
    functions, choice = check_tools(TOOLS + [{"type": "function", "function": {"name": "ping"}}], None)
    assert choice == "auto"
    assert functions == [WEATHER, SEARCH, {"name": "ping", "parameters": {"type": "object", "properties": {}}}]
    named = {"type": "function", "function": {"name": "search"}}
    assert check_tools(TOOLS, named) == ([WEATHER, SEARCH], named)
    assert check_tools(TOOLS, "none") == ([WEATHER, SEARCH], "none")


# ---------------------------------------------------------------- forced_call_constraint


def forced_schema(functions, tool_choice, parallel=True):
    params = forced_call_constraint(functions, tool_choice, parallel)
    assert isinstance(params, StructuredOutputParams) and params.kind == "json"
    return json.loads(params.json)


def call_schema(function):
    return {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": function["parameters"]},
            "required": ["name", "arguments"]}


def test_forced_named_call_is_the_functions_parameters():
    assert forced_schema([WEATHER, SEARCH], {"type": "function", "function": {"name": "search"}}) == \
        SEARCH["parameters"]


def test_forced_required_one_tool():
    assert forced_schema([WEATHER], "required") == {"type": "array", "minItems": 1,
                                                    "items": call_schema(WEATHER)}


def test_forced_required_two_tools():
    assert forced_schema([WEATHER, SEARCH], "required") == {
        "type": "array", "minItems": 1, "items": {"anyOf": [call_schema(WEATHER), call_schema(SEARCH)]}}


def test_forced_required_without_parallel_calls_is_one_call():
    schema = forced_schema([WEATHER, SEARCH], "required", parallel=False)
    assert (schema["minItems"], schema["maxItems"]) == (1, 1)


@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_forced_nothing_for_auto_and_none(tool_choice):
    assert forced_call_constraint([WEATHER], tool_choice) is None


# ---------------------------------------------------------------- prepare_conversation


ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": [1, 2]}'}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}


def test_prompt_lists_each_function_in_tools_tags():
    functions, _ = check_tools(TOOLS + [{"type": "function", "function": {"name": "ping"}}], None)
    prompt = tools_system_prompt(functions)
    listed = prompt.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0].split("\n")
    assert [json.loads(line) for line in listed] == [{"type": "function", "function": f} for f in functions]
    assert CALL_OPEN in prompt and CALL_CLOSE in prompt


def test_prompt_becomes_the_first_system_message():
    messages, tools = prepare_conversation([{"role": "user", "content": "Hi"}], [WEATHER], NO_TOOLS_TEMPLATE)
    assert tools is None
    assert messages == [{"role": "system", "content": tools_system_prompt([WEATHER])},
                        {"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("role", ["system", "developer"])
def test_prompt_is_appended_to_a_first_system_message(role):
    conversation = [{"role": role, "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    messages, _ = prepare_conversation(conversation, [WEATHER], None)
    assert messages == [{"role": "system", "content": "Be brief.\n\n" + tools_system_prompt([WEATHER])},
                        {"role": "user", "content": "Hi"}]
    assert conversation[0]["role"] == role  # the request's own messages are not changed


def test_no_functions_no_prompt():
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert prepare_conversation(conversation, [], NO_TOOLS_TEMPLATE) == (conversation, None)


def test_calls_and_results_become_hermes_text():
    conversation = [{"role": "user", "content": "Weather?"},
                    {**ASSISTANT_CALL, "content": "Checking."}, TOOL_RESULT]
    messages, tools = prepare_conversation(conversation, [WEATHER], NO_TOOLS_TEMPLATE)
    assert tools is None
    assert messages[1:] == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": '
                                         '{"city": "Paris", "days": [1, 2]}}\n</tool_call>'},
        {"role": "user", "content": '<tool_response>\n{"temp": 21}\n</tool_response>'},
    ]


def test_hermes_text_of_calls_parses_back():
    second = {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": "{}"}}
    message = {**ASSISTANT_CALL, "tool_calls": ASSISTANT_CALL["tool_calls"] + [second]}
    messages, _ = prepare_conversation([message], [WEATHER, SEARCH], NO_TOOLS_TEMPLATE)
    content, calls = parse_all(HermesParser(), messages[1]["content"])
    assert content is None
    assert name_args(calls) == [("get_weather", {"city": "Paris", "days": [1, 2]}), ("search", {})]


def test_template_with_tools_gets_them_and_objects_as_arguments():
    undecodable = {"id": "call_2", "type": "function", "function": {"name": "search", "arguments": "{oops"}}
    conversation = [{"role": "user", "content": "Hi"},
                    {**ASSISTANT_CALL, "tool_calls": ASSISTANT_CALL["tool_calls"] + [undecodable]}, TOOL_RESULT]
    messages, tools = prepare_conversation(conversation, [WEATHER, SEARCH], TOOLS_TEMPLATE)
    assert tools == TOOLS
    assert messages[0] == conversation[0] and messages[2] == TOOL_RESULT
    assert messages[1] == {**ASSISTANT_CALL, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}},
        undecodable]}
    assert ASSISTANT_CALL["tool_calls"][0]["function"]["arguments"].startswith("{")  # input unchanged


def test_template_with_tools_and_no_functions():
    conversation = [{"role": "user", "content": "Hi"}]
    assert prepare_conversation(conversation, [], TOOLS_TEMPLATE) == (conversation, None)


# ---------------------------------------------------------------- constraints.py


def test_from_response_format():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert from_response_format(None) is None
    assert from_response_format({"type": "text"}) is None
    assert from_response_format({"type": "json_object"}) == StructuredOutputParams(json_object=True)
    params = from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert json.loads(params.json) == schema


@pytest.mark.parametrize("response_format, field", [
    ({"type": "json_schema"}, "response_format.json_schema:"),
    ({"type": "json_schema", "json_schema": "{}"}, "response_format.json_schema:"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema:"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}, "response_format.json_schema.schema:"),
    ({"type": "xml"}, "response_format.type:"),
    ({}, "response_format.type:"),
])
def test_from_response_format_errors(response_format, field):
    with pytest.raises(ValueError) as err:
        from_response_format(response_format)
    assert str(err.value).startswith(field)


def body(**fields) -> SimpleNamespace:
    """A request body with only the constraint fields."""
    empty = dict(response_format=None, structured_outputs=None, guided_json=None, guided_regex=None,
                 guided_choice=None, guided_grammar=None)
    return SimpleNamespace(**{**empty, **fields})


def test_requested_constraint_each_field():
    schema = {"type": "object"}
    assert requested_constraint(body()) is None
    assert requested_constraint(body(response_format=ResponseFormat(type="text"))) is None
    field, params = requested_constraint(body(response_format=ResponseFormat(
        type="json_schema", json_schema={"name": "x", "schema": schema})))
    assert (field, json.loads(params.json)) == ("response_format", schema)
    assert requested_constraint(body(structured_outputs={"regex": "[a-z]+"})) == (
        "structured_outputs", StructuredOutputParams(regex="[a-z]+"))
    field, params = requested_constraint(body(guided_json=schema))
    assert (field, json.loads(params.json)) == ("guided_json", schema)
    assert requested_constraint(body(guided_regex="a|b")) == ("guided_regex", StructuredOutputParams(regex="a|b"))
    assert requested_constraint(body(guided_choice=["yes", "no"])) == (
        "guided_choice", StructuredOutputParams(choice=("yes", "no")))
    assert requested_constraint(body(guided_grammar='root ::= "a"')) == (
        "guided_grammar", StructuredOutputParams(grammar='root ::= "a"'))
    # "text" asks for nothing, so it does not count as a second constraint.
    assert requested_constraint(body(response_format=ResponseFormat(type="text"), guided_regex="a"))[0] == \
        "guided_regex"


@pytest.mark.parametrize("fields, first, second", [
    (dict(response_format=ResponseFormat(type="json_object"), guided_json={}), "response_format", "guided_json"),
    (dict(structured_outputs={"regex": "a"}, guided_choice=["a"]), "structured_outputs", "guided_choice"),
    (dict(guided_regex="a", guided_grammar="root ::= \"a\""), "guided_regex", "guided_grammar"),
    (dict(response_format=ResponseFormat(type="json_object"), structured_outputs={"json_object": True}),
     "response_format", "structured_outputs"),
])
def test_requested_constraint_refuses_two(fields, first, second):
    with pytest.raises(ValueError) as err:
        requested_constraint(body(**fields))
    assert str(err.value).startswith(f"{second}:")
    assert first in str(err.value)


@pytest.mark.parametrize("fields, message", [
    (dict(structured_outputs={"regex": "a", "pattern": "b", "jsn": {}}), "structured_outputs: unknown field(s) "
                                                                         "['jsn', 'pattern']"),
    (dict(structured_outputs="a"), "structured_outputs: must be an object"),
    (dict(structured_outputs={}), "structured_outputs: exactly one"),
    (dict(guided_regex=""), "guided_regex: must be a non-empty string"),
    (dict(guided_choice="yes"), "guided_choice: must be a list of strings"),
    (dict(guided_json=5), "guided_json: must be a JSON schema"),
    (dict(response_format=ResponseFormat(type="json_schema")), "response_format.json_schema:"),
    (dict(response_format=ResponseFormat.model_construct(type="yaml")), "response_format.type:"),
])
def test_requested_constraint_errors_name_the_field(fields, message):
    with pytest.raises(ValueError) as err:
        requested_constraint(body(**fields))
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("message, source, expected", [
    ("structured_outputs.json: x", "response_format", "response_format.json_schema.schema: x"),
    ("structured_outputs.json: x", "tool_choice", "tools: x"),
    ("structured_outputs.regex: x", "guided_regex", "guided_regex: x"),
    ("structured_outputs: x", "guided_json", "guided_json: x"),
    ("structured_outputs.json: x", "structured_outputs", "structured_outputs.json: x"),
    ("prompt: x", "response_format", "prompt: x"),
    ("no field here", "tool_choice", "no field here"),
])
def test_rename_field(message, source, expected):
    assert rename_field(message, source) == expected
