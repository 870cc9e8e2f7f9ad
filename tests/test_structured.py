"""Structured output (remask/structured.py, diffusion/parts/constrain.py): the parameters' checks,
the matcher on the tiny models' character vocabulary and on a byte-level BPE one, the commit
filter's soundness under any rule, and outputs of the tiny AR and LLaDA models (drop-in functions
and the engine) that parse and validate with `jsonschema` whenever they finish with `stop`; the
server's `response_format` / `structured_outputs` and its 400s.

Each decoding check counts its `stop` share (printed with `-s`, asserted > 0: a check that never
sees a `stop` checks nothing)."""
from __future__ import annotations

import json
import random
import re
import warnings

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import remask  # noqa: E402

from helpers import Server  # noqa: E402
from remask.structured import (StructuredOutputsError, StructuredOutputsParams,  # noqa: E402
                               compile_structure)
from remask.zoo.charset import EOS_ID, EOT_ID, MASK_ID, PAD_ID, decode_answer, encode_chat  # noqa: E402

S = StructuredOutputsParams

# Schemas of different shapes; strings and numbers bounded so a tiny model's answer can close.
SCHEMAS = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                              "age": {"type": "integer", "minimum": 0, "maximum": 120}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                                  "ok": {"type": "boolean"}},
                 "required": ["id", "ok"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 3},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
             "required": ["colour"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -5, "maximum": 5},
                                                  "b": {"type": "string", "maxLength": 3}},
                 "required": ["a"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "boolean"}},
        "required": ["k", "v"], "additionalProperties": False}},
    "number_or_null": {"type": "object", "properties": {"score": {"anyOf": [{"type": "null"},
                                                                            {"type": "integer", "minimum": 10, "maximum": 20}]}},
                       "required": ["score"], "additionalProperties": False},
}
REGEX = r"[A-Z][a-z]{1,4}-[0-9]{2}"
CHOICE = ["yes", "no", "maybe"]
PROMPTS = ["What is the capital of France?", "sort 3 1 2", "colour of grass"]
STOP_SHARES: dict[str, tuple[int, int]] = {}


@pytest.fixture(scope="module")
def llada():
    return remask.load("tiny-llada")


@pytest.fixture(scope="module")
def ar():
    return remask.load("tiny-ar")


def check_answer(text: str, params: StructuredOutputsParams) -> None:
    """A complete answer satisfies its structure (jsonschema for JSON)."""
    if params.json is not None:
        jsonschema.validate(json.loads(text), params.json)
    elif params.json_object:
        assert isinstance(json.loads(text), dict)
    elif params.regex is not None:
        assert re.fullmatch(params.regex, text), text
    elif params.choice is not None:
        assert text in params.choice, text


def batch(prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Chat prompts left-padded into one batch, and their attention mask."""
    rows = [encode_chat(p) for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD_ID] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def tally(name: str, stops: int, total: int) -> None:
    STOP_SHARES[name] = (stops, total)
    print(f"\n[structured] {name}: {stops}/{total} finished with stop")
    assert stops > 0, f"{name}: no answer finished with stop (the check saw no complete structure)"


# ---- parameters ---------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, field, needle", [
    ({}, "structured_outputs", "exactly one"),
    ({"json": {"type": "object"}, "regex": "a"}, "structured_outputs", "['json', 'regex']"),
    ({"json": {"type": "nope"}}, "json", "Invalid type"),
    ({"json": "{not json"}, "json", "not valid JSON"),
    ({"json": [1, 2]}, "json", "must be an object"),
    ({"regex": "a(b"}, "regex", "unclosed group"),
    ({"regex": ""}, "regex", "non-empty"),
    ({"choice": []}, "choice", "non-empty list"),
    ({"choice": "yes"}, "choice", "non-empty list"),
    ({"choice": ["a", 3]}, "choice", "non-empty str"),
    ({"grammar": "start: missing_rule"}, "grammar", "unknown name"),
    ({"json_object": "yes"}, "json_object", "must be True"),
])
def test_params_are_validated_naming_the_field(kwargs, field, needle):
    with pytest.raises(StructuredOutputsError) as err:
        S(**kwargs)
    assert err.value.field == field and needle in str(err.value)
    assert isinstance(err.value, ValueError)


def test_params_forms_and_sampling_params():
    assert remask.StructuredOutputsParams is S
    assert S(json='{"type": "integer"}').json == {"type": "integer"}
    assert S.from_json({"choice": ["a", "b"]}).choice == ("a", "b")
    with pytest.raises(StructuredOutputsError, match="unknown fields"):
        S.from_json({"json_schema": {}})
    assert S.from_response_format({"type": "text"}) is None
    assert S.from_response_format({"type": "json_object"}).json_object is True
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "boolean"}, "strict": True}}
    assert S.from_response_format(rf).json == {"type": "boolean"}
    with pytest.raises(StructuredOutputsError, match=r"^response_format\.json_schema\.schema"):
        S.from_response_format({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}})
    params = remask.SamplingParams(max_tokens=8, structured_outputs={"regex": "[ab]+"})
    assert isinstance(params.structured_outputs, S)
    for clash in ({"ignore_eos": True}, {"min_tokens": 2}, {"stop": ["}"]}):
        with pytest.raises(ValueError, match="structured_outputs does not combine"):
            remask.SamplingParams(max_tokens=8, structured_outputs=S(regex="a"), **clash)


def test_shortest_answer_bounds():
    assert S(json=SCHEMAS["flat"]).min_bytes() == len('{"name":"","age":0}')
    assert S(json=SCHEMAS["nested"]).min_bytes() == len('{"user":{"id":1,"ok":true}}')
    assert S(json=SCHEMAS["pattern"]).min_bytes() == len('{"code":"AA00"}')
    assert S(json=SCHEMAS["number_or_null"]).min_bytes() == len('{"score":10}')
    assert S(choice=CHOICE).min_bytes() == 2 and S(regex=REGEX).min_bytes() == 5
    assert S(grammar='start: "a"+').min_bytes() is None


# ---- the matcher ----------------------------------------------------------------------------------

def ids_of(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_matcher_on_the_character_vocabulary(llada):
    _, tok = llada
    compiled = compile_structure(S(json=SCHEMAS["flat"]), tok, 128, (MASK_ID,))
    assert compile_structure(S(json=SCHEMAS["flat"]), tok, 128, (MASK_ID,)) is compiled   # cached
    assert compiled.min_tokens == len('{"name":"","age":0}')
    m = compiled.matcher([EOS_ID, EOT_ID])
    allowed = m.allowed()
    assert allowed.shape == (128,) and allowed.nonzero().flatten().tolist() == ids_of(tok, "{")
    good = ids_of(tok, '{"name":"ab","age":7}')
    assert m.accepts(good) == len(good) and m.accepts(good + [EOS_ID, EOS_ID]) == len(good) + 2
    assert m.accepts(ids_of(tok, '{"name":"ab",') + [EOS_ID]) == len('{"name":"ab",')   # EOS only when complete
    assert m.position == 0
    m.advance(good[:7])                  # '{"name"'
    with pytest.raises(ValueError):
        m.advance(ids_of(tok, ":}"))     # not accepted: nothing changes
    assert m.position == 7
    m.advance(good[7:9])
    assert not m.allowed()[[EOS_ID, EOT_ID, MASK_ID, PAD_ID]].any()       # specials never inside a structure
    clone = m.clone()
    clone.advance(good[9:] + [EOT_ID])
    assert clone.ended and clone.allowed().nonzero().flatten().tolist() == [EOS_ID, EOT_ID]
    assert not clone.try_advance(ids_of(tok, "a")[0]) and clone.try_advance(EOS_ID)
    assert m.position == 9 and not m.ended                                # the clone is independent
    clone.rollback(len(good) - 9 + 2)
    assert clone.position == 9 and not clone.ended and clone.accepts(good[9:]) == len(good) - 9
    logits = torch.zeros(2, 128)
    masked = m.mask_logits(logits)
    assert torch.isinf(masked[:, ~m.allowed()]).all() and (masked[:, m.allowed()] == 0).all()


def test_validate_tokens_agrees_with_consuming(llada):
    """`accepts` (llguidance's validate_tokens, no commit) counts what consuming one by one accepts."""
    _, tok = llada
    compiled = compile_structure(S(json=SCHEMAS["nested"]), tok, 128, (MASK_ID,))
    text = '{"user":{"id":3,"ok":false}}'
    rng = random.Random(0)
    chars = list('{}[]":,0123456789abcdefghijklmnopqrstuvwxyz ')
    for trial in range(60):
        cut = rng.randrange(len(text) + 1)
        tail = "".join(rng.choice(chars) for _ in range(rng.randrange(4)))
        ids = ids_of(tok, text[:cut] + tail)
        m = compiled.matcher([EOS_ID])
        expected = 0
        probe = m.clone()
        for t in ids:
            if not probe.try_advance(t):
                break
            expected += 1
        assert m.accepts(ids) == expected, (text[:cut] + tail)


def test_matcher_on_a_byte_level_bpe_tokenizer():
    """A Hugging Face byte-level BPE vocabulary (multi-character tokens, Ġ spaces) compiles through
    llguidance's own tokenizer reader; a token spanning structure characters is judged by its bytes."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    bpe = tokenizers.ByteLevelBPETokenizer()
    corpus = ['{"name": "alice", "age": 31}', '{"name":"bob","age":7}', '[1, 2, 3]', '{"ok": true}'] * 50
    bpe.train_from_iterator(corpus, vocab_size=300, min_frequency=2, special_tokens=["<eos>", "<mask>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>", mask_token="<mask>")
    eos, mask = tok.eos_token_id, tok.mask_token_id
    compiled = compile_structure(S(json=SCHEMAS["flat"]), tok, len(tok), (mask,))
    assert compiled.vocab.max_token_bytes > 1
    ids = ids_of(tok, '{"name":"bob","age":7}')
    assert len(ids) < len('{"name":"bob","age":7}')          # multi-character tokens
    m = compiled.matcher([eos])
    assert m.accepts(ids + [eos]) == len(ids) + 1
    assert m.accepts(ids_of(tok, '{"name": "bob"')) < len(ids_of(tok, '{"name": "bob"'))   # whitespace is off
    assert not m.allowed()[[eos, mask]].any()
    m.advance(ids)
    assert m.allowed().nonzero().flatten().tolist() == [eos]


# ---- the commit filter: sound under any rule ----------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_commit_filter_is_sound_under_random_rules(llada, seed):
    """A random 'rule' commits random positions with the random logits' candidates, any number per
    step: the filter keeps every canvas a valid prefix, the window always fills, and a completed
    structure ends with EOS to the end of the answer."""
    from remask.diffusion.parts.constrain import CommitFilter

    _, tok = llada
    params = S(json=SCHEMAS[["flat", "nested", "array", "optional", "array_of_objects", "enum"][seed]])
    compiled = compile_structure(params, tok, 128, (MASK_ID,))
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    P, G, block = 3, 48, 16
    B = 2
    x = torch.full((B, P + G), MASK_ID)
    flt = CommitFilter([compiled.matcher([EOS_ID]) for _ in range(B)], MASK_ID, P, G)
    for start in range(P, P + G, block):
        end = start + block
        for _ in range(20 * block):
            if not (x[:, start:end] == MASK_ID).any() or all(flt.finished):
                break
            logits = torch.randn(B, block, 128, generator=gen) * 3
            logits[:, :, ids_of(tok, '{}[]":,0123456789')] += 4   # structure-ish tokens are likely
            logits = flt.mask_frontier(logits, start, end, 0)
            x0 = logits.argmax(-1)
            prior = x[:, start:end].clone()
            holes = (prior == MASK_ID)
            for b in range(B):
                for i in holes[b].nonzero().flatten().tolist():
                    if rng.random() < 0.4:
                        x[b, start + i] = x0[b, i]
            flt.filter(x, prior, x0, logits, start, end, 0)
            for b in range(B):   # invariant: the canvas's committed prefix is a valid prefix
                run = []
                for t in x[b, P:].tolist():
                    if t == MASK_ID:
                        break
                    run.append(t)
                assert compiled.matcher([EOS_ID]).accepts(run) == len(run)
        assert all(flt.finished) or not (x[:, start:end] == MASK_ID).any(), "the window did not fill"
    for b in range(B):
        answer = x[b, P:].tolist()
        assert MASK_ID not in answer
        assert compiled.matcher([EOS_ID]).accepts(answer) == G
        if EOS_ID in answer:
            cut = answer.index(EOS_ID)
            assert set(answer[cut:]) == {EOS_ID}
            check_answer(decode_answer(answer), params)


# ---- decoding with the tiny models ----------------------------------------------------------------

LLADA_RULES = {
    "schedule": dict(steps=32, block_length=32),
    "blocks": dict(steps=32, block_length=8),
    "threshold": dict(steps=32, block_length=8, threshold=0.9),
    "dual_cache": dict(steps=32, block_length=8, use_cache="dual"),
}


@pytest.mark.parametrize("rule", list(LLADA_RULES))
def test_llada_json_schemas(llada, rule):
    model, tok = llada
    stops = total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # gen_length beyond the tiny model's trained 16
        for name, schema in SCHEMAS.items():
            params = S(json=schema)
            prompt, mask = batch(PROMPTS[:2])
            out = remask.generate(model, prompt, mask, gen_length=32, structured_outputs=params, **LLADA_RULES[rule])
            for row in out[:, prompt.shape[1]:].tolist():
                assert MASK_ID not in row
                total += 1
                ended = [t for t in row if t in (EOS_ID, EOT_ID)]
                compiled = compile_structure(params, tok, 128, (MASK_ID,))
                assert compiled.matcher([EOS_ID, EOT_ID]).accepts(row) == len(row), (name, decode_answer(row))
                if ended:
                    stops += 1
                    check_answer(decode_answer(row), params)
    tally(f"llada {rule}", stops, total)


def test_llada_regex_choice_grammar_and_sampling(llada):
    model, _ = llada
    stops = total = 0
    prompt, mask = batch(PROMPTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in (S(regex=REGEX), S(choice=CHOICE), S(json_object=True),
                       S(grammar='start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]{1,2}/')):
            for kw in (dict(), dict(temperature=1.0, generator=torch.Generator().manual_seed(1))):
                out = remask.generate(model, prompt, mask, steps=24, gen_length=24, block_length=8,
                                      structured_outputs=params, **kw)
                for row in out[:, prompt.shape[1]:].tolist():
                    total += 1
                    assert MASK_ID not in row
                    if EOS_ID in row or EOT_ID in row:
                        stops += 1
                        text = decode_answer(row)
                        if params.grammar is not None:
                            assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})?\)", text), text
                        else:
                            check_answer(text, params)
    tally("llada regex/choice/json_object/grammar", stops, total)


def test_ar_json_schemas_regex_and_choice(ar):
    model, _ = ar
    stops = total = 0
    prompt, mask = batch(PROMPTS)
    cases = [S(json=s) for s in SCHEMAS.values()] + [S(regex=REGEX), S(choice=CHOICE)]
    for params in cases:
        for kw in (dict(), dict(temperature=1.0, generator=torch.Generator().manual_seed(2))):
            out = remask.ar_generate(model, prompt, mask, max_new_tokens=40, structured_outputs=params, **kw)
            for row in out[:, prompt.shape[1]:].tolist():
                total += 1
                if EOS_ID in row:
                    stops += 1
                    check_answer(decode_answer(row), params)
                else:   # out of budget: a valid prefix
                    compiled = compile_structure(params, ar[1], 128, (MASK_ID,))
                    assert compiled.matcher([EOS_ID]).accepts(row) == len(row)
    tally("ar (drop-in)", stops, total)


@pytest.mark.parametrize("name", ["tiny-ar", "tiny-llada"])
def test_engine_finish_reasons(name):
    llm = remask.LLM(name)
    extra = dict(block_length=8, steps=32) if name == "tiny-llada" else {}
    stops = total = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for schema in (SCHEMAS["flat"], SCHEMAS["enum"], SCHEMAS["array"]):
            params = remask.SamplingParams(max_tokens=32, n=2, temperature=1.0, seed=3,
                                           structured_outputs=S(json=schema), **extra)
            for out in llm.generate(PROMPTS[:2], params, use_tqdm=False):
                for c in out.outputs:
                    total += 1
                    assert c.finish_reason in ("stop", "length")
                    if c.finish_reason == "stop":
                        stops += 1
                        jsonschema.validate(json.loads(c.text), schema)
        # a budget that cannot hold the shortest valid answer is refused, naming max_tokens
        with pytest.raises(ValueError, match=r"^max_tokens: 8 is shorter"):
            llm.generate(["x"], remask.SamplingParams(max_tokens=8, structured_outputs=S(json=SCHEMAS["flat"]),
                                                      **({"block_length": 8, "steps": 8} if extra else {})),
                         use_tqdm=False)
        # a budget too short for the answer where no bound is known up front (a grammar): finish
        # reason length, the text a valid prefix
        short = remask.SamplingParams(max_tokens=8, structured_outputs=S(grammar='start: "abcdefghijklmnop"'),
                                      **({"block_length": 8, "steps": 8} if extra else {}))
        c = llm.generate(["x"], short, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "length" and c.text == "abcdefgh"
    tally(f"engine {name}", stops, total)


def test_structured_outputs_with_the_cache_methods(llada):
    model, tok = llada
    prompt = torch.tensor([encode_chat("hi")])
    # FreeDave, dInfer's rules, WINO, Dream's decoders and the dKV / d2 / Elastic caches enforce it
    # (tests/test_structured_methods.py); here the drop-in and the engine, each once
    params = S(regex="a+")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = remask.generate(model, prompt, gen_length=16, block_length=16, steps=16, use_cache=remask.DKVCache(),
                              structured_outputs=params)
        assert compile_structure(params, tok, 128, (MASK_ID,)).matcher((EOS_ID, EOT_ID)).valid(
            out[0, prompt.shape[1]:].tolist())
        llm = remask.LLM("tiny-llada")
        c = llm.generate(["x"], remask.SamplingParams(max_tokens=16, use_cache=remask.D2Cache(),
                                                      structured_outputs=params), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason in ("stop", "length") and set(c.text) <= {"a"} and c.text


# ---- HTTP ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from remask.serve import AsyncEngine, build_app

    engines = {"tiny-llada": AsyncEngine(remask.LLM("tiny-llada")), "tiny-ar": AsyncEngine(remask.LLM("tiny-ar"))}
    server = Server(build_app(engines))
    yield server
    server.stop()
    for engine in engines.values():
        engine.shutdown()


def test_http_response_format_and_structured_outputs(served):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", timeout=60, max_retries=0)
    schema = SCHEMAS["flat"]
    stops = total = 0
    for model, extra in (("tiny-ar", {}), ("tiny-llada", {"block_length": 8, "steps": 32})):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "sort 3 1 2"}], max_tokens=32, n=2, temperature=1.0,
            seed=5, response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                                            "strict": True}},
            extra_body=extra)
        for choice in reply.choices:
            total += 1
            if choice.finish_reason == "stop":
                stops += 1
                jsonschema.validate(json.loads(choice.message.content), schema)
        reply = client.completions.create(model=model, prompt="colour of grass", max_tokens=32,
                                          extra_body={"structured_outputs": {"choice": CHOICE}, **extra})
        total += 1
        assert reply.choices[0].finish_reason == "stop" and reply.choices[0].text in CHOICE
        stops += 1
        reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=32,
                                               response_format={"type": "json_object"}, extra_body=extra)
        total += 1
        if reply.choices[0].finish_reason == "stop":
            stops += 1
            assert isinstance(json.loads(reply.choices[0].message.content), dict)
    tally("http", stops, total)


@pytest.mark.parametrize("extra, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "Invalid type"),
    ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format", "name"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs", "unknown name"),
    ({"structured_outputs": {"json": {}, "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"choice": ["a"]}, "response_format": {"type": "json_object"}}, "response_format", "not both"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS["nested"]}},
      "max_tokens": 5}, "max_tokens", "shorter than the shortest answer"),
])
def test_http_400s_name_the_field(served, extra, param, needle):
    import httpx

    body = {"model": "tiny-ar", "prompt": "hi", "max_tokens": 16, **extra}
    response = httpx.post(f"{served.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"].split(".")[0] == param and needle in error["message"], error


# ---- CLI ----------------------------------------------------------------------------------------

def test_cli_json_schema(tmp_path):
    from remask.cli import main

    schema = SCHEMAS["enum"]
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    out = tmp_path / "out.jsonl"
    for model, extra in (("tiny-ar", []), ("tiny-llada", ["--block-length", "8", "--steps", "32"])):
        assert main(["generate", model, "--prompt", "colour of grass", "--prompt", "sort 3 1 2", "--chat", "--quiet",
                     "--json-schema", str(tmp_path / "schema.json"), "--max-tokens", "32", "--output", str(out),
                     *extra]) == 0
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(rows) == 2 and all(r["finish_reason"] == "stop" for r in rows), rows
        for r in rows:
            jsonschema.validate(json.loads(r["text"]), schema)
    assert main(["generate", "tiny-ar", "--prompt", "x", "--json-schema", str(tmp_path / "missing.json")]) == 2
    # the chat model is shown the schema through its template (as the server shows it) and answers right
    answer = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    (tmp_path / "answer.json").write_text(json.dumps(answer))
    assert main(["generate", "tiny-ar-chat", "--prompt", "sort 52814", "--prompt", "reverse remask", "--chat",
                 "--quiet", "--json-schema", str(tmp_path / "answer.json"), "--max-tokens", "64",
                 "--output", str(out)]) == 0
    assert [json.loads(line)["text"] for line in out.read_text().splitlines()] == ['{"answer":"12458"}',
                                                                                   '{"answer":"ksamer"}']
