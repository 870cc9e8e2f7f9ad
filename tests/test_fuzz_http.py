"""A hostile client against `remask serve` (issue 29): Hypothesis writes request bodies — OpenAI's
fields with values of every type and size, unknown fields, broken JSON, bytes that are not UTF-8 —
and sends them to a real server on 127.0.0.1. Every answer must be a valid completion or a
well-formed OpenAI error (a 4xx, never a 5xx or a dropped connection), and afterwards the server
is healthy and has not grown past a memory budget. Bounded: the "ci" profile's examples
(tests/conftest.py), small valid work (answers of at most 12 tokens), 30 s per request."""
from __future__ import annotations

import collections
import json
import os

import pytest

pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import remask  # noqa: E402
from remask.serve import AsyncEngine, build_app  # noqa: E402

from test_serve import KEY, Server  # noqa: E402

RSS_BUDGET = 512 << 20   # growth allowed over the whole fuzz run (the models are loaded before)

junk = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                 st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=40),
                 st.lists(st.integers(-5, 400), max_size=5), st.dictionaries(st.text(max_size=8), st.integers(), max_size=3))


def small_or(values, low=-3, high=12):
    """Mostly a small int (valid work stays cheap), else a huge one or another type altogether."""
    return st.one_of(st.integers(low, high), st.sampled_from(values), junk)


text = st.one_of(st.sampled_from(["sort 52814", "reverse abcd", "a\ud800b", "", " " * 3]),
                 st.text(max_size=60), st.text(alphabet=st.characters(codec="utf-8"), max_size=20))
message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(["user", "system", "assistant", "tool"]), junk),
                                 "content": st.one_of(text, junk, st.lists(
                                     st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "x"]),
                                                            "text": text}), max_size=3))})
common = {
    "model": st.one_of(st.sampled_from(["tiny-llada", "tiny-ar"]), junk),
    "max_tokens": small_or([0, 10**9, 2**63, 4097]),
    "n": small_or([129, 10_000, 2**31], low=-1, high=2),
    "seed": st.one_of(st.integers(0, 99), st.sampled_from([-1, 2**64, 2**70]), junk),
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([1e308, -1.0, float("nan")]), junk),
    "top_p": st.one_of(st.floats(0, 1), junk),
    "top_k": small_or([10**9]),
    "steps": small_or([10**6, 10**9]),
    "block_length": small_or([10**9], low=-1, high=12),
    "threshold": st.one_of(st.floats(0, 1), junk),
    "stream": st.one_of(st.booleans(), junk),
    "stop": st.one_of(st.lists(text, max_size=3), text, junk,
                      st.sampled_from([["#"] * 20_000, ["#" * 10_000], ["#" * 256] * 64])),   # issue 37
    "ignore_eos": st.one_of(st.booleans(), junk),
    "min_tokens": small_or([10**9], low=-1, high=4),
    # decoder / cache configs past their meaningful maximum, at it, or with a crash-prone value (issue 37)
    "decoder": st.one_of(st.fixed_dictionaries({"name": st.just("freedave"), "draft_steps": small_or([10**9])}),
                         st.sampled_from([{"name": "wino", "accept_ratio": 1e308}, {"name": "wino", "accept_cap": 10**9}]),
                         junk),
    "use_cache": st.one_of(st.fixed_dictionaries({"name": st.just("elastic"),
                                                  "window_length": small_or([10**9], low=1)}),
                           st.sampled_from([{"name": "elastic", "track_num": 10**9}, {"name": "d2cache", "inflate_w": 10**9},
                                            {"name": "vicinity", "prefix_look": 10**9}]), junk),
    "frobnicate": junk,   # an unknown field
}


# Values every model takes (so that valid requests, and requests with one bad field, are common)
valid = {
    "model": st.sampled_from(["tiny-llada", "tiny-ar"]),
    "max_tokens": st.integers(1, 12),
    "n": st.integers(1, 2),
    "seed": st.integers(0, 99),
    "temperature": st.floats(0, 2),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "stop": st.lists(st.sampled_from(["1", "a", "\n"]), max_size=2),
}


def body_of(required: dict, required_valid: dict) -> st.SearchStrategy:
    """A valid body, a valid body with one field of `common` (any value), or any mix of fields."""
    good = st.fixed_dictionaries({**required_valid, "model": valid["model"]},
                                 optional={k: v for k, v in valid.items() if k != "model"})
    return st.one_of(good, st.builds(_with_field, good, st.sampled_from(sorted(common)), junk),
                     st.fixed_dictionaries(required, optional=common))


def _with_field(body: dict, name: str, value) -> dict:
    return {**body, name: value}


prompts = st.sampled_from(["sort 52814", "reverse abcd", "add 12 30", "name a colour"])
completions = body_of({"prompt": st.one_of(text, st.lists(st.integers(-3, 400), max_size=6), junk)},
                      {"prompt": prompts})
chats = body_of({"messages": st.one_of(st.lists(message, min_size=1, max_size=3), junk)},
                {"messages": st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": prompts}),
                                      min_size=1, max_size=2)})
raw_bodies = st.one_of(st.binary(max_size=64), st.sampled_from([b"{", b"[]", b"null", b'{"prompt": "a"', b"\xff\xfe"]))


@pytest.fixture(scope="module")
def server():
    engines = {"tiny-llada": AsyncEngine(remask.LLM("tiny-llada")), "tiny-ar": AsyncEngine(remask.LLM("tiny-ar"))}
    served = Server(build_app(engines, api_key=KEY))
    with httpx.Client(base_url=served.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as client:
        client.post("/v1/completions", json={"model": "tiny-llada", "prompt": "sort 1", "max_tokens": 4})
        yield served, client, _rss_bytes()
    served.stop()
    for engine in engines.values():
        engine.shutdown()


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


STATUSES: collections.Counter = collections.Counter()   # what the fuzzing reached (printed with -s)


def check_answer(response: "httpx.Response", streamed: bool) -> None:
    STATUSES[response.status_code] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        assert error["param"] is None or isinstance(error["param"], str)
        assert error["code"] is None or isinstance(error["code"], str)
        return
    assert response.status_code == 200
    if streamed:
        lines = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert lines and lines[-1] == "data: [DONE]", response.text[-300:]
        for line in lines[:-1]:
            chunk = json.loads(line[len("data: "):])
            assert "choices" in chunk or "error" in chunk
        return
    answer = response.json()
    assert answer["object"] in ("text_completion", "chat.completion") and answer["choices"]


def send(client: "httpx.Client", path: str, body: dict) -> "httpx.Response":
    # json.dumps's defaults, as a careless client: lone surrogates escaped (\ud800), NaN and
    # Infinity written bare (not JSON)
    return client.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


FUZZ = settings(suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], deadline=None)


@FUZZ
@given(body=completions)
def test_completions_answer_every_body_well(server, body):
    _, client, _ = server
    check_answer(send(client, "/v1/completions", body), streamed=body.get("stream") is True)


@FUZZ
@given(body=chats)
def test_chat_answers_every_body_well(server, body):
    _, client, _ = server
    check_answer(send(client, "/v1/chat/completions", body), streamed=body.get("stream") is True)


@FUZZ
@given(raw=raw_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_broken_bodies_get_a_400_in_openai_shape(server, raw, path):
    _, client, _ = server
    response = client.post(path, content=raw, headers={"Content-Type": "application/json"})
    check_answer(response, streamed=False)
    assert 400 <= response.status_code < 500


def test_the_server_is_healthy_and_within_its_memory_budget_after_the_fuzzing(server):
    served, client, rss_before = server
    assert client.get("/health").status_code == 200
    ok = client.post("/v1/completions", json={"model": "tiny-llada", "prompt": "sort 52814", "max_tokens": 8})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None
    assert _rss_bytes() - rss_before < RSS_BUDGET
    print("fuzzed statuses:", dict(STATUSES))
    assert STATUSES[200] > 0 and sum(n for code, n in STATUSES.items() if 400 <= code < 500) > 0
