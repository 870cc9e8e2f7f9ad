"""Structured output and tool calls over HTTP, with the `openai` client against `remask serve`'s
app on 127.0.0.1 (tiny-ar and tiny-llada, both enforced): `response_format` from a pydantic
model (its `model_json_schema()`, and the client's own `chat.completions.parse`), tool calls with
`tool_choice` named / `"required"` / `"auto"` / `"none"`, `n > 1`, streaming (text, a named
call's argument deltas, a whole call at the end), and the 400s that name `tools` / `tool_choice`.

Every answer that finishes with `stop` (or `tool_calls`) is parsed and validated; the share of
such answers is counted per check (printed with `-s`, asserted > 0)."""
from __future__ import annotations

import json
from typing import Literal

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel, ConfigDict, Field  # noqa: E402

import remask  # noqa: E402

from helpers import Server  # noqa: E402
from remask.structured import TOOL_CALL_TAG  # noqa: E402

MODELS = {"tiny-ar": {}, "tiny-llada": {"block_length": 8, "steps": 48}}
STOPS: dict[str, tuple[int, int]] = {}


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")     # additionalProperties: false (else extra keys are valid)
    name: str = Field(max_length=6)
    count: int = Field(ge=0, le=99)
    colour: Literal["red", "blue", "green"]


SORT = {"type": "object", "properties": {"digits": {"type": "string", "pattern": "^[0-9]{1,6}$"}},
        "required": ["digits"], "additionalProperties": False}
COLOUR = {"type": "object", "properties": {"c": {"enum": ["red", "blue", "green"]}, "n": {"type": "integer",
                                                                                          "minimum": 0, "maximum": 9}},
          "required": ["c"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "sort", "description": "sort digits", "parameters": SORT}},
         {"type": "function", "function": {"name": "colour", "parameters": COLOUR}}]
SCHEMA_OF = {"sort": SORT, "colour": COLOUR}
MESSAGES = [{"role": "user", "content": "sort 3 1 2"}]


@pytest.fixture(scope="module")
def served():
    from remask.serve import AsyncEngine, build_app

    engines = {name: AsyncEngine(remask.LLM(name)) for name in MODELS}
    server = Server(build_app(engines))
    yield server
    server.stop()
    for engine in engines.values():
        engine.shutdown()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", timeout=120, max_retries=0)


def tally(name: str, stops: int, total: int) -> None:
    STOPS[name] = (stops, total)
    print(f"\n[structured-http] {name}: {stops}/{total} finished with stop / tool_calls")
    assert stops > 0, f"{name}: no answer completed (the check saw no complete structure)"


def check_call(call, names=("sort", "colour")) -> None:
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


# ---- response_format ------------------------------------------------------------------------------

def test_response_format_from_a_pydantic_model(client):
    stops = total = 0
    fmt = {"type": "json_schema", "json_schema": {"name": "Item", "schema": Item.model_json_schema(), "strict": True}}
    for model, extra in MODELS.items():
        reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=64, n=2, temperature=1.0,
                                               seed=4, response_format=fmt, extra_body=extra)
        assert len(reply.choices) == 2
        for choice in reply.choices:
            total += 1
            assert choice.finish_reason in ("stop", "length")
            if choice.finish_reason == "stop":
                stops += 1
                Item.model_validate_json(choice.message.content)
        # the client's own helper: it sends a strict json_schema built from the model and parses the answer
        parsed = client.chat.completions.parse(model=model, messages=MESSAGES, max_tokens=64, seed=1,
                                               response_format=Item, extra_body=extra)
        total += 1
        if parsed.choices[0].finish_reason == "stop":
            stops += 1
            assert isinstance(parsed.choices[0].message.parsed, Item)
    tally("response_format (pydantic)", stops, total)


# ---- tool calls -----------------------------------------------------------------------------------

def test_named_tool_call(client):
    stops = total = 0
    for model, extra in MODELS.items():
        reply = client.chat.completions.create(
            model=model, messages=MESSAGES, max_tokens=48, n=2, temperature=1.0, seed=2, tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "sort"}}, extra_body=extra)
        ids = set()
        for choice in reply.choices:
            total += 1
            if choice.finish_reason == "tool_calls":
                stops += 1
                assert choice.message.content is None and len(choice.message.tool_calls) == 1
                call = choice.message.tool_calls[0]
                check_call(call, ("sort",))
                ids.add(call.id)
            else:
                assert choice.finish_reason == "length" and not choice.message.tool_calls
        assert len(ids) == sum(c.finish_reason == "tool_calls" for c in reply.choices)   # each call its own id
    tally("tool_choice named", stops, total)


def test_required_tool_call(client):
    stops = total = 0
    for model, extra in MODELS.items():
        for prompt in ("sort 3 1 2", "colour of grass"):
            reply = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt}], max_tokens=64, n=2, temperature=1.0,
                seed=3, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, extra_body=extra)
            for choice in reply.choices:
                total += 1
                if choice.finish_reason == "tool_calls":
                    stops += 1
                    check_call(choice.message.tool_calls[0])
                else:
                    assert choice.finish_reason == "length"
    tally("tool_choice required", stops, total)


def test_auto_and_none(client):
    """`auto`: a text answer never begins with the call's tag, and one that does is a valid call
    (the tiny models answer in text here; the call branch is also checked below on given outputs)."""
    stops = total = 0
    for model, extra in MODELS.items():
        for seed in (0, 1):
            reply = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, n=2,
                                                   temperature=1.0, seed=seed, tools=TOOLS, tool_choice="auto",
                                                   extra_body=extra)
            for choice in reply.choices:
                total += 1
                if choice.finish_reason == "tool_calls":
                    stops += 1
                    check_call(choice.message.tool_calls[0])
                else:
                    assert not choice.message.tool_calls and not choice.message.content.startswith(TOOL_CALL_TAG)
                    stops += choice.finish_reason == "stop"
        plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, seed=0, tools=TOOLS,
                                               tool_choice="none", extra_body=extra)
        without = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, seed=0,
                                                 extra_body=extra)
        assert plain.choices[0].message.content == without.choices[0].message.content
        assert not plain.choices[0].message.tool_calls
    tally("tool_choice auto", stops, total)


def test_auto_recognises_a_call():
    """The `auto` grammar: text or `<tool_call>` + a call; the answer is read as a call exactly
    when it begins with the tag (complete structures only), whole or streamed."""
    from types import SimpleNamespace

    from remask.serve.app import _CallStream, _message
    from remask.structured import compile_structure, tool_call_spec
    from remask.zoo.charset import EOS_ID, MASK_ID

    spec = tool_call_spec(TOOLS, "auto")
    _, tok = remask.load("tiny-ar")
    compiled = compile_structure(spec.structure, tok, 128, (MASK_ID,))
    call = TOOL_CALL_TAG + '{"name":"colour","arguments":{"c":"red","n":3}}'
    for text, complete in ((call, True), ("hello <x>", True), ("<tool_cal", True),
                           (TOOL_CALL_TAG + '{"name":"colour","arguments":{"c":"pink"}}', False),
                           (TOOL_CALL_TAG + "hello", False), (TOOL_CALL_TAG, False)):
        ids = list(tok(text, add_special_tokens=False)["input_ids"])
        assert compiled.matcher([EOS_ID]).valid(ids + [EOS_ID]) is complete, text
    message, reason = _message(SimpleNamespace(text=call, finish_reason="stop"), spec)
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "colour", "arguments": '{"c":"red","n":3}'}
    assert _message(SimpleNamespace(text="hi", finish_reason="stop"), spec) == (
        {"role": "assistant", "content": "hi"}, "stop")
    assert _message(SimpleNamespace(text=call[:20], finish_reason="length"), spec)[1] == "length"
    stream = _CallStream(spec, 0)
    assert stream.update("<tool", None) is None                       # held: could be either
    assert stream.update(call[:25], None) is None                     # a call, its name not complete yet
    first = stream.update(call[:30], None)["delta"]["tool_calls"]     # id and name first ...
    assert first == [{"index": 0, "id": first[0]["id"], "type": "function",
                      "function": {"name": "colour", "arguments": ""}}]
    assert stream.update(call[:40], None) is None                     # `"arguments":`, no value yet
    more = stream.update(call[:48], None)["delta"]["tool_calls"]      # ... then argument fragments
    assert more == [{"index": 0, "function": {"arguments": '{"c":"re'}}]
    last = stream.update(call, "stop")
    assert last["finish_reason"] == "tool_calls"
    assert last["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": 'd","n":3}'}}]
    text = _CallStream(spec, 1)
    assert text.update("<", None) is None
    assert text.update("<b", None)["delta"] == {"content": "<b"}
    assert text.update("<b>x", "stop") == {"index": 1, "delta": {"content": ">x"}, "finish_reason": "stop"}


def test_parallel_tool_calls_is_held_by_the_grammar():
    """`parallel_tool_calls` true (OpenAI's default): `required` / `auto` answers may hold several
    calls (`call+`); false: at most one (`call`). Checked on the compiled structure itself."""
    from remask.structured import compile_structure, tool_call_spec
    from remask.zoo.charset import EOS_ID, MASK_ID

    _, tok = remask.load("tiny-ar")
    one = TOOL_CALL_TAG + '{"name":"colour","arguments":{"c":"red"}}'
    two = one + TOOL_CALL_TAG + '{"name":"sort","arguments":{"digits":"123"}}'
    for choice in ("required", "auto"):
        for parallel, two_ok in ((None, True), (True, True), (False, False)):
            spec = tool_call_spec(TOOLS, choice, parallel)
            compiled = compile_structure(spec.structure, tok, 128, (MASK_ID,))
            for text, ok in ((one, True), (two, two_ok)):
                ids = list(tok(text, add_special_tokens=False)["input_ids"])
                assert compiled.matcher([EOS_ID]).valid(ids + [EOS_ID]) is ok, (choice, parallel, text)
        assert [c["name"] for c in tool_call_spec(TOOLS, choice).calls_of(two)] == ["colour", "sort"]
        assert tool_call_spec(TOOLS, choice).calls_of(two)[1]["arguments"] == '{"digits":"123"}'


@pytest.mark.parametrize("parallel", [True, False])
def test_parallel_tool_calls_over_http(client, parallel):
    """Every call of every choice is valid and has its own id; with false, one call at most."""
    counts = []
    for model, extra in MODELS.items():
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "colour of grass"}], max_tokens=64, n=4,
            temperature=1.0, seed=11, tools=TOOLS, tool_choice="required", parallel_tool_calls=parallel,
            extra_body=extra)
        for choice in reply.choices:
            if choice.finish_reason == "tool_calls":
                calls = choice.message.tool_calls
                counts.append(len(calls))
                for call in calls:
                    check_call(call)
                assert len({c.id for c in calls}) == len(calls)
    print(f"\n[structured-http] parallel_tool_calls={parallel}: calls per answer {counts}")
    assert counts
    if not parallel:
        assert set(counts) == {1}


def test_conversation_with_tool_messages(client):
    """A tool round trip: the assistant's call and the tool's result go back in `messages`."""
    model, extra = "tiny-ar", MODELS["tiny-ar"]
    first = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=48, tools=TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "sort"}})
    call = first.choices[0].message.tool_calls[0]
    messages = [*MESSAGES, first.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": "123"}]
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=16, tools=TOOLS,
                                           tool_choice="none", extra_body=extra)
    assert reply.choices[0].finish_reason in ("stop", "length")
    # the tiny models' template reads `content` only: the call and the result are rendered in the
    # fallback (the call as the tool grammar writes it, the result as a user turn), not dropped
    _, tok = remask.load(model)
    arguments = json.loads(call.function.arguments)
    rendered = (f'<|bos|><|user|>sort 3 1 2<|eot|><|assistant|>{TOOL_CALL_TAG}'
                + json.dumps({"name": "sort", "arguments": arguments}, separators=(",", ":"))
                + "<|eos|><|user|><tool_response>123</tool_response><|eot|><|assistant|>")
    assert reply.usage.prompt_tokens == len(tok(rendered, add_special_tokens=False)["input_ids"])


def test_a_template_that_reads_tools_gets_them_as_they_are():
    """A chat template that renders `tool_calls` and the `tool` role receives the messages
    unchanged; one that does not gets the documented fallback."""
    import copy

    from remask.structured import messages_for_template, template_tool_support

    _, tok = remask.load("tiny-ar")
    aware = copy.deepcopy(tok)
    aware.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}<|user|>result:{{ m['content'] }}<|eot|>"
        "{% elif m['role'] == 'user' %}<|user|>{{ m['content'] }}<|eot|>"
        "{% else %}<|assistant|>{{ m['content'] }}{% for c in m.get('tool_calls', []) %}"
        "call:{{ c['function']['name'] }}({{ c['function']['arguments'] }}){% endfor %}<|eos|>{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [{"role": "user", "content": "sort 3 1 2"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "sort", "arguments": '{"digits":"312"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "123"}]
    assert template_tool_support(aware) == (True, True) and template_tool_support(tok) == (False, False)
    assert messages_for_template(aware, messages) == messages
    fallback = messages_for_template(tok, messages)
    assert fallback[1] == {"role": "assistant", "content": TOOL_CALL_TAG + '{"name":"sort","arguments":{"digits":"312"}}'}
    assert fallback[2] == {"role": "user", "content": "<tool_response>123</tool_response>"}


# ---- streaming ------------------------------------------------------------------------------------

def _collect(stream):
    """Per choice: content text, the call (id, name, arguments joined), the finish reason, and
    how many chunks carried tool_calls."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            entry = out.setdefault(c.index, {"content": "", "id": None, "name": None, "arguments": "", "finish": None,
                                             "call_chunks": 0})
            if c.delta.content:
                entry["content"] += c.delta.content
            for tc in c.delta.tool_calls or []:
                entry["call_chunks"] += 1
                calls = entry.setdefault("calls", [])
                if tc.id:                                # a call's first delta: id, type, name
                    assert tc.index == len(calls) and tc.type == "function" and tc.function.name
                    calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
                assert tc.index == len(calls) - 1        # fragments of the call begun last
                calls[tc.index]["arguments"] += tc.function.arguments or ""
                entry["id"], entry["name"], entry["arguments"] = (calls[0]["id"], calls[0]["name"],
                                                                  calls[0]["arguments"])
            if c.finish_reason:
                entry["finish"] = c.finish_reason
    return out


def test_streaming(client):
    stops = total = 0
    for model, extra in MODELS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": "Item", "schema": Item.model_json_schema()}}
        base = dict(model=model, messages=MESSAGES, temperature=1.0, seed=6, n=2, extra_body=extra)
        whole = client.chat.completions.create(max_tokens=64, response_format=fmt, **base)
        streamed = _collect(client.chat.completions.create(max_tokens=64, response_format=fmt, stream=True, **base))
        for choice in whole.choices:                     # the same answers, streamed as committed text
            assert streamed[choice.index]["content"] == choice.message.content
            assert streamed[choice.index]["finish"] == choice.finish_reason
            total += 1
            if choice.finish_reason == "stop":
                stops += 1
                Item.model_validate_json(streamed[choice.index]["content"])
        named = {"type": "function", "function": {"name": "colour"}}
        whole = client.chat.completions.create(max_tokens=48, tools=TOOLS, tool_choice=named, **base)
        streamed = _collect(client.chat.completions.create(max_tokens=48, tools=TOOLS, tool_choice=named,
                                                           stream=True, **base))
        for choice in whole.choices:                     # a named call: id + name first, then argument deltas
            got = streamed[choice.index]
            assert got["finish"] == choice.finish_reason
            total += 1
            if choice.finish_reason == "tool_calls":
                stops += 1
                assert got["name"] == "colour" and got["id"].startswith("call_") and got["content"] == ""
                assert got["arguments"] == choice.message.tool_calls[0].function.arguments
                jsonschema.validate(json.loads(got["arguments"]), COLOUR)
        streamed = _collect(client.chat.completions.create(max_tokens=64, tools=TOOLS, tool_choice="required",
                                                           stream=True, **base))
        for got in streamed.values():                    # required: id + name first, then argument deltas
            total += 1
            if got["finish"] == "tool_calls":
                stops += 1
                for call in got["calls"]:
                    assert call["id"].startswith("call_") and call["name"] in SCHEMA_OF
                    jsonschema.validate(json.loads(call["arguments"]), SCHEMA_OF[call["name"]])
        streamed = _collect(client.chat.completions.create(max_tokens=48, tools=TOOLS, tool_choice="auto",
                                                           stream=True, **base))
        for got in streamed.values():
            assert got["finish"] in ("stop", "length", "tool_calls")
            assert not got["content"].startswith(TOOL_CALL_TAG)
            if got["finish"] == "tool_calls":
                assert got["content"] == "" and all(c["name"] in SCHEMA_OF for c in got["calls"])
    tally("streaming", stops, total)


# ---- 400s -----------------------------------------------------------------------------------------

def _bad_tool(**function):
    return [{"type": "function", "function": {"name": "f", **function}}]


@pytest.mark.parametrize("extra, param, needle", [
    ({"tools": []}, "tools", "non-empty list"),
    ({"tools": [{"type": "retrieval"}]}, "tools", "tools[0]"),
    ({"tools": _bad_tool(name="has space")}, "tools", "tools[0].function.name"),
    ({"tools": _bad_tool(parameters={"type": "nope"})}, "tools", "tools[0].function.parameters"),
    ({"tools": _bad_tool(oops=1)}, "tools", "unknown fields ['oops']"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools", "listed twice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice",
     "'missing', which is not in tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "only with tool_choice 'none'"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "sort"}}, "max_tokens": 5},
     "max_tokens", "shorter than the shortest answer"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls", "true or false"),
])
def test_400s_name_the_field(served, extra, param, needle):
    import httpx

    body = {"model": "tiny-ar", "messages": MESSAGES, "max_tokens": 32, **extra}
    response = httpx.post(f"{served.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0].split("[")[0] == param and needle in error["message"], error


def test_completions_route_refuses_tools(served):
    import httpx

    response = httpx.post(f"{served.url}/v1/completions", json={"model": "tiny-ar", "prompt": "x", "tools": TOOLS},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["code"] == "unsupported_parameter"
