"""Every structure of tests/structured_cases.py (20 JSON schemas, a regex, a choice list, a
grammar) through every decoding family that accepts `structured_outputs` today, on the shipped
tiny models, through the engine (`remask.LLM`).

A family joins the matrix when the engine does not refuse it: each candidate is probed with
`SamplingParams(...)` + `LLMEngine.add_request` (then aborted), so the matrix grows as enforcement
lands in more decoders (the refused ones are listed, printed with `-s`). Every output that
finishes with `stop` is checked (jsonschema for JSON); one that finishes with `length` must be a
valid prefix (the matcher accepts it). The share of `stop` per family is printed and asserted > 0:
a family that never completes a structure checks nothing."""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")

import remask  # noqa: E402
from remask.structured import StructuredOutputsParams, compile_structure  # noqa: E402
from remask.zoo.charset import MASK_ID  # noqa: E402
from structured_cases import CASES  # noqa: E402

MAX_TOKENS = 48
PROMPT = [{"role": "user", "content": "sort 3 1 2"}]
LLADA = dict(block_length=8, steps=MAX_TOKENS)

# family → (model, SamplingParams fields); APD's verifier is filled in by `candidate_params`
CANDIDATES: dict[str, tuple[str, dict]] = {
    "ar": ("tiny-ar", {}),
    "llada block rule": ("tiny-llada", LLADA),
    "llada threshold + dual cache": ("tiny-llada", dict(block_length=8, threshold=0.9, use_cache="dual")),
    "llada freedave": ("tiny-llada", dict(block_length=8, decoder={"name": "freedave"})),
    "llada dinfer threshold": ("tiny-llada", dict(block_length=8, decoder={"name": "threshold"})),
    "llada wino": ("tiny-llada", dict(block_length=8, decoder={"name": "wino"})),
    "dream sampler (alg)": ("tiny-llada", dict(steps=MAX_TOKENS, alg="entropy")),
    "apd (tiny-llada + tiny-ar)": ("tiny-llada", dict(apd=True)),
}
SHARES: dict[str, tuple[int, int]] = {}
REFUSED: dict[str, str] = {}


@pytest.fixture(scope="module")
def llms():
    return {name: remask.LLM(name) for name in ("tiny-ar", "tiny-llada")}


def candidate_params(llms, family: str, structured, **extra) -> remask.SamplingParams:
    _, fields = CANDIDATES[family]
    fields = dict(fields)
    if fields.pop("apd", False):
        fields["decoder"] = remask.APDConfig(verifier=llms["tiny-ar"].engine.model)
    return remask.SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=structured, **fields, **extra)


def accepted(llms, family: str) -> bool:
    """Whether the engine takes a structured request of `family` (the probe is aborted at once)."""
    model, _ = CANDIDATES[family]
    engine = llms[model].engine
    try:
        params = candidate_params(llms, family, {"regex": "[a-z]+"})
        engine.add_request(f"probe-{family}", llms[model].chat_ids(PROMPT), params)
    except (ValueError, TypeError) as err:
        REFUSED[family] = str(err).split("\n")[0][:120]
        return False
    engine.abort_request(f"probe-{family}")
    return True


@pytest.mark.parametrize("family", list(CANDIDATES))
def test_family_holds_every_structure(llms, family):
    if not accepted(llms, family):
        print(f"\n[structured-matrix] {family}: refused ({REFUSED[family]})")
        pytest.skip(f"{family} does not accept structured_outputs yet: {REFUSED[family]}")
    model, _ = CANDIDATES[family]
    llm = llms[model]
    prompt = llm.chat_ids(PROMPT)
    # each case greedy, and sampled (temperature 1, seeded) for half the JSON ones where the decoder
    # samples: one engine call, batched
    requests = [(case, candidate_params(llms, family, case.structured)) for case in CASES]
    for case in CASES[:20:2]:
        try:
            requests.append((case, candidate_params(llms, family, case.structured, temperature=1.0, seed=7)))
        except ValueError:              # a greedy-only decoder (FreeDave, dInfer's rules, WINO)
            break
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # generation past the tiny models' trained length
        outs = llm.generate([prompt] * len(requests), [p for _, p in requests], use_tqdm=False)
    stops = 0
    tokenizer = llm.tokenizer
    for (case, params), out in zip(requests, outs):
        c = out.outputs[0]
        assert c.finish_reason in ("stop", "length"), (case, c.finish_reason)
        if c.finish_reason == "stop":
            stops += 1
            case.check(c.text)
        else:
            compiled = compile_structure(StructuredOutputsParams.from_json(case.structured), tokenizer,
                                         llm.engine.model.config.vocab_size, (MASK_ID,))
            assert compiled.matcher([]).accepts(list(c.token_ids)) == len(c.token_ids), (case, c.text)
    SHARES[family] = (stops, len(requests))
    print(f"\n[structured-matrix] {family}: {stops}/{len(requests)} finished with stop")
    assert stops > 0, f"{family}: no answer finished with stop"
