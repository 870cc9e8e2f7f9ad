"""The chat models' data: the tasks of `remask.zoo.tasks` asked in every format a chat API asks.

One `Example` is a conversation as an OpenAI client sends it (`messages`, `tools`,
`response_format`) and the answer the model is trained on (`target`), with every answer that
counts as correct. The kinds:

* `plain`: the task as today (`sort 458073` → `034578`), no tools, no format;
* `json`: a `response_format` json_schema, one of `SHAPES` (`{"answer":"034578"}` with the
  answer's key drawn from `ANSWER_KEYS`, an integer for a sum half the time; the nested
  `{"task":"sort","result":{"value":"034578","length":6}}`; `{"question":..,"answer":..}`;
  `{"task":..,"answers":[..]}`), the answer compact JSON in the schema's key order;
* `json_object`: `{"type": "json_object"}` (no schema) → `{"answer":"034578"}`;
* `tool_call`: `tools` offered (a shuffled subset of `TOOLS`, always the ones the prompt needs);
  the answer is the call(s) as remask's tool grammar writes them
  (`<tool_call>{"name":"add","arguments":{"a":3,"b":5}}`); two calls in one answer when the
  prompt joins two problems (`3+5 and capital of Peru`);
* `tool_answer`: the same conversation continued: the assistant's `tool_calls`, one `tool`
  message per call (the result as text, or `{"result": ...}`), and the final text answer
  (two results joined by `", "`);
* `tool_text`: tools offered, none of them for this task (a colour, or `sort` with only
  `capital` offered): the answer is text.

Streams are seeded like `tasks.problems`: `examples(n, seed)` is always the same list; the
training script draws from `TRAIN_SEED`, held-out sets from `EVAL_SEED`.

    >>> from remask.zoo.formats import examples
    >>> e = examples(1, seed=5, kinds=("tool_call",), tasks=("add",))[0]
    >>> [t["function"]["name"] for t in e.tools], e.messages[-1]["content"]
    (['reverse', 'add', 'greet', 'sort'], '5+8 and reverse ubfd')
    >>> e.target
    '<tool_call>{"name":"add","arguments":{"a":5,"b":8}}<tool_call>{"name":"reverse","arguments":{"word":"ubfd"}}'
    >>> e.is_correct(e.target), e.right_tool('<tool_call>{"name":"add","arguments":{"a":5,"b":8}}')
    (True, False)
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any, Sequence

from remask.zoo import tasks

KINDS = ("plain", "json", "json_object", "tool_call", "tool_answer", "tool_text")
TOOL_TASKS = ("sort", "reverse", "add", "greet", "capital")   # the tasks a tool answers
ANSWER_KEYS = ("answer", "result", "value", "output", "text")
SHAPES = ("answer", "task_result", "question_answer", "task_answers")
CALL_TAG = "<tool_call>"   # remask.structured.TOOL_CALL_TAG (tests check they agree)
TOOL_RESULT_AS_JSON = 0.3  # share of tool results written {"result": ...} rather than as plain text
PARALLEL = 0.35            # share of tool conversations with two problems (two calls in one answer)


def _tool(tool_name: str, description: str, **params: str) -> dict[str, Any]:
    types = {"str": "string", "int": "integer"}
    return {"type": "function", "function": {
        "name": tool_name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": types[v]} for k, v in params.items()},
                       "required": list(params)}}}


# task → its tool (OpenAI's `tools` entry)
TOOLS: dict[str, dict[str, Any]] = {
    "sort": _tool("sort", "Sort the digits of a number in increasing order", digits="str"),
    "reverse": _tool("reverse", "Reverse a word", word="str"),
    "add": _tool("add", "Add two integers", a="int", b="int"),
    "greet": _tool("greet", "Greet a person by name", name="str"),
    "capital": _tool("capital", "The capital city of a country", country="str"),
}


@dataclass(frozen=True)
class Example:
    kind: str
    task: str                                  # the task, or "task+task" for two problems
    messages: tuple[dict[str, Any], ...]       # the conversation up to the answer (OpenAI's form)
    tools: tuple[dict[str, Any], ...] | None   # OpenAI's `tools`, or None
    response_format: dict[str, Any] | None     # OpenAI's `response_format`, or None
    target: str                                # the answer a training example uses
    answers: tuple[str, ...]                   # every answer that counts as correct

    @property
    def needs_tool(self) -> bool:
        return self.kind == "tool_call"

    def is_correct(self, text: str) -> bool:
        """Exact for text; JSON compared as values (whitespace and key order free); calls compared
        as (name, arguments) values, in any order."""
        if self.kind in ("json", "json_object"):
            value = _json_value(text)
            return value is not None and any(value == json.loads(a) for a in self.answers)
        if self.kind == "tool_call":
            calls = parse_calls(text)
            return calls is not None and any(_same_calls(calls, parse_calls(a)) for a in self.answers)
        return text in self.answers

    def right_tool(self, text: str) -> bool:
        """`auto` tool choice judged: the right tool(s) called (arguments not checked) when the task
        needs one, a text answer (no call) when it does not."""
        calls = parse_calls(text)
        if not self.needs_tool:
            return not text.startswith(CALL_TAG)
        want = sorted(c["name"] for c in parse_calls(self.answers[0]) or [])
        return calls is not None and sorted(c["name"] for c in calls) == want

    def schema(self) -> dict[str, Any] | None:
        """The JSON Schema asked for (json), {"type": "object"} (json_object), else None."""
        if self.response_format is None:
            return None
        if self.response_format["type"] == "json_object":
            return {"type": "object"}
        return self.response_format["json_schema"]["schema"]


def _json_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def parse_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls of an answer `<tool_call>{"name":..,"arguments":{..}}<tool_call>…` as
    `[{"name", "arguments"}]` (arguments parsed), or None when it is not a sequence of calls."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        if not text.startswith(CALL_TAG, at):
            return None
        try:
            value, at = decoder.raw_decode(text, at + len(CALL_TAG))
        except ValueError:
            return None
        if not isinstance(value, dict) or set(value) != {"name", "arguments"}:
            return None
        calls.append(value)
    return calls or None


def _same_calls(a: list[dict[str, Any]] | None, b: list[dict[str, Any]] | None) -> bool:
    key = lambda c: json.dumps(c, sort_keys=True)   # noqa: E731
    return a is not None and b is not None and sorted(map(key, a)) == sorted(map(key, b))


def compact(value: Any) -> str:
    """JSON as the structured-output grammar writes it (no whitespace, keys in the given order)."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _json_example(rng: random.Random, p: tasks.Problem) -> Example:
    shape = rng.choice(SHAPES)
    if shape == "answer":
        key = rng.choice(ANSWER_KEYS)
        as_int = p.task == "add" and rng.random() < 0.5
        schema = _object({key: {"type": "integer" if as_int else "string"}})
        value = lambda a: {key: int(a) if as_int else a}   # noqa: E731
    elif shape == "task_result":
        schema = _object({"task": {"type": "string"},
                          "result": _object({"value": {"type": "string"}, "length": {"type": "integer"}})})
        value = lambda a: {"task": p.task, "result": {"value": a, "length": len(a)}}   # noqa: E731
    elif shape == "question_answer":
        schema = _object({"question": {"type": "string"}, "answer": {"type": "string"}})
        value = lambda a: {"question": p.prompt, "answer": a}   # noqa: E731
    else:
        schema = _object({"task": {"type": "string"}, "answers": {"type": "array", "items": {"type": "string"}}})
        value = lambda a: {"task": p.task, "answers": [a]}   # noqa: E731
    response_format = {"type": "json_schema", "json_schema": {"name": shape, "schema": schema}}
    return Example("json", p.task, ({"role": "user", "content": p.prompt},), None, response_format,
                   compact(value(p.target)), tuple(compact(value(a)) for a in p.answers))


def _arguments(p: tasks.Problem) -> dict[str, Any]:
    """The arguments of the call that answers `p` (read from its prompt)."""
    if p.task == "add":
        a, b = p.prompt.split("+")
        return {"a": int(a), "b": int(b)}
    last = p.prompt.split()[-1]
    return {{"sort": "digits", "reverse": "word", "greet": "name", "capital": "country"}[p.task]: last}


def _offered(rng: random.Random, needed: Sequence[str], excluded: Sequence[str] = ()) -> tuple[dict[str, Any], ...]:
    """The needed tools plus a random number of others (never an excluded one), shuffled."""
    others = [t for t in TOOL_TASKS if t not in needed and t not in excluded]
    names = list(dict.fromkeys(needed)) + rng.sample(others, rng.randint(0 if needed else 1, len(others)))
    rng.shuffle(names)
    return tuple(TOOLS[n] for n in names)


def _tool_example(rng: random.Random, kind: str, first: tasks.Problem, parallel: float) -> Example:
    batch = [first]
    if rng.random() < parallel:   # the second problem from the training mixture's tool tasks
        batch.append(_draw(rng, {t: tasks.TRAIN_WEIGHTS[t] for t in TOOL_TASKS}))
    prompt = " and ".join(p.prompt for p in batch)
    task = "+".join(p.task for p in batch)
    tools = _offered(rng, [p.task for p in batch])
    calls = [{"name": p.task, "arguments": _arguments(p)} for p in batch]
    call_text = "".join(CALL_TAG + compact(c) for c in calls)
    user = {"role": "user", "content": prompt}
    if kind == "tool_call":
        return Example(kind, task, (user,), tools, None, call_text, (call_text,))
    ids = [f"call_{rng.randrange(16**8):08x}" for _ in batch]
    assistant = {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": c["name"], "arguments": compact(c["arguments"])}}
        for i, c in zip(ids, calls)]}
    results = [{"role": "tool", "tool_call_id": i,
                "content": compact({"result": int(p.target) if p.task == "add" else p.target})
                if rng.random() < TOOL_RESULT_AS_JSON else p.target} for i, p in zip(ids, batch)]
    answer = ", ".join(p.target for p in batch)
    return Example(kind, task, (user, assistant, *results), tools, None, answer, (answer,))


def _draw(rng: random.Random, weights: dict[str, float]) -> tasks.Problem:
    return tasks.draw(rng, {t: w for t, w in weights.items() if w > 0})


def example(rng: random.Random, kind: str, weights: dict[str, float] | None = None,
            parallel: float = PARALLEL) -> Example:
    """One example of `kind`, its task drawn with `weights` (default: the training mixture)
    among the tasks that can be asked in that kind; a tool conversation has two problems with
    probability `parallel`."""
    weights = dict(tasks.TRAIN_WEIGHTS if weights is None else weights)
    if kind in ("tool_call", "tool_answer"):
        weights = {t: w for t, w in weights.items() if t in TOOL_TASKS}
    p = _draw(rng, weights)
    user = ({"role": "user", "content": p.prompt},)
    if kind == "plain":
        return Example(kind, p.task, user, None, None, p.target, p.answers)
    if kind == "json":
        return _json_example(rng, p)
    if kind == "json_object":
        value = lambda a: compact({"answer": a})   # noqa: E731
        return Example(kind, p.task, user, None, {"type": "json_object"}, value(p.target),
                       tuple(value(a) for a in p.answers))
    if kind == "tool_text":
        return Example(kind, p.task, user, _offered(rng, [], excluded=[p.task]), None, p.target, p.answers)
    if kind in ("tool_call", "tool_answer"):
        return _tool_example(rng, kind, p, parallel)
    raise ValueError(f"kind must be one of {list(KINDS)}, got {kind!r}")


def examples(n: int, seed: int, kinds: Sequence[str] | None = None,
             tasks: Sequence[str] | None = None) -> list[Example]:
    """`n` examples, kinds taken in turn, each kind's tasks in turn where `tasks` names them
    (default: every task the kind can ask, drawn uniformly), content seeded."""
    from remask.zoo import tasks as task_module

    kinds = tuple(KINDS) if kinds is None else tuple(kinds)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"kinds must be a non-empty subset of {list(KINDS)}, got {list(kinds)}")
    names = tuple(task_module.TASKS) if tasks is None else tuple(tasks)
    if not names or any(t not in task_module.TASKS for t in names):
        raise ValueError(f"tasks must be a non-empty subset of {sorted(task_module.TASKS)}, got {list(names)}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        allowed = [t for t in names if kind not in ("tool_call", "tool_answer") or t in TOOL_TASKS]
        if not allowed:
            raise ValueError(f"kind {kind!r} needs one of the tasks {list(TOOL_TASKS)}, got {list(names)}")
        task = allowed[(i // len(kinds)) % len(allowed)]
        out.append(example(rng, kind, {task: 1.0}))
    return out
