"""Structured output under Prophet, KLASS and DAEDAL (issue 45): their own loops hold the structure with
`diffusion/parts/constrain.py`'s commit filter (Prophet through LLaDA's block loop, plus its exit's fill; KLASS
and DAEDAL around their own commits), on the shipped tiny LLaDA (and, for KLASS's Dream loop, a tiny random Dream
checkpoint on the same character vocabulary).

Every output: no mask token, a valid prefix of its structure, and complete (an end token, the answer parses and
validates) wherever the method stopped; each row equals the row decoded alone (no batch-mate changes it); the
engine's tokens equal the drop-in call's. Without a structure the methods' fixture tests (tests/test_prophet.py,
test_klass.py, test_daedal.py) hold token for token."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("llguidance")
pytest.importorskip("jsonschema")

import remask  # noqa: E402
from remask.diffusion.parts.checks import CombinationError  # noqa: E402
from remask.structured import StructuredOutputsParams as S  # noqa: E402
from remask.zoo.charset import EOS_ID, EOT_ID, MASK_ID, encode_chat  # noqa: E402

from test_structured import CHOICE, REGEX, SCHEMAS, batch, tally  # noqa: E402
from test_structured_methods import _engine_rows, check_rows, dream, same_tokens  # noqa: E402,F401

CASES = [S(json=SCHEMAS[name]) for name in ("flat", "nested", "array", "enum", "optional", "number_or_null")] \
    + [S(regex=REGEX), S(choice=CHOICE)]
PROMPTS = ["What is the capital of France?", "sort 3 1 2", "colour of grass"]
ENDS = (EOS_ID, EOT_ID)
# Prophet's answer positions: every generated position (0 counts from the prompt's start); its thresholds: an exit
# at the first forward, one in the late phase (after the loop committed under the structure), none
WHOLE = dict(answer_start_pos=0, answer_length=64)
METHODS = {
    "prophet exit at once": dict(decoder=remask.Prophet(**WHOLE, early_exit_thresholds={"early": 0.0}), steps=32),
    "prophet late exit": dict(decoder=remask.Prophet(**WHOLE, early_exit_thresholds={
        "early": 1e9, "mid": 1e9, "late": 0.0}), steps=16),
    "prophet no exit": dict(decoder=remask.Prophet(), steps=32),
    "klass": dict(decoder=remask.KLASS()),
    "klass max_conf": dict(decoder=remask.KLASS(conf_threshold=0.5, unmask_strategy="max_conf"), steps=16),
    "daedal": dict(decoder=remask.DAEDAL(initial_gen_length=8, eos_check_tokens=8)),
    "daedal inserts": dict(decoder=remask.DAEDAL(initial_gen_length=16, expansion_factor=4, low_conf_threshold=0.9,
                                                 expand_eos_confidence_threshold=2.0, eos_check_tokens=4)),
    # no expansion of its own (the canvas stays 8 + 4 EOS): it grows only because the structure is still open
    "daedal grows for the structure": dict(decoder=remask.DAEDAL(
        initial_gen_length=8, eos_confidence_threshold=0.0, expand_eos_confidence_threshold=0.0, eos_check_tokens=8)),
}


@pytest.fixture(scope="module")
def llada():
    return remask.load("tiny-llada")


def answers(out: torch.Tensor, P: int) -> list[list[int]]:
    return out[:, P:].tolist()


@pytest.mark.parametrize("method", list(METHODS))
def test_llada_answers_hold_to_the_structure_and_to_their_rows(llada, method):
    """Valid, complete (every answer ends: 32 tokens fit each case), and each row as decoded alone."""
    model, tok = llada
    prompt, mask = batch(PROMPTS)
    counts = [0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # gen_length beyond the tiny model's trained 16
        for case, params in enumerate(CASES):
            out = remask.generate(model, prompt, mask, gen_length=32, block_length=8, structured_outputs=params,
                                  **METHODS[method])
            rows = answers(out, prompt.shape[1])
            check_rows(rows, params, tok, method, counts)
            assert all(any(t in ENDS for t in row) for row in rows), (method, params.kind, rows)
            # one row alone (no pads, no batch-mates) per structure, each prompt's row in turn (every row of the
            # batch is checked alone under several structures)
            b = case % len(PROMPTS)
            alone = torch.tensor([encode_chat(PROMPTS[b])])
            solo = remask.generate(model, alone, gen_length=32, block_length=8, structured_outputs=params,
                                   **METHODS[method])[0, alone.shape[1]:].tolist()
            assert solo == rows[b][:len(solo)] and set(rows[b][len(solo):]) <= {EOS_ID}, (method, b)
    assert counts[0] == counts[1]
    tally(f"llada {method}", *counts)


def test_klass_on_dream(dream):  # noqa: F811 (the fixture imported above)
    """KLASS's Dream loop (shifted logits, one block) under a structure."""
    model, tok, _ = dream
    prompt, mask = batch(PROMPTS)
    counts = [0, 0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in CASES:
            out = remask.diffusion_generate(model, prompt, attention_mask=mask, max_new_tokens=32,
                                            structured_outputs=params, tokenizer=tok, decoder=remask.KLASS())
            check_rows(answers(out, prompt.shape[1]), params, tok, "klass dream", counts)
    tally("dream klass", *counts)


@pytest.mark.parametrize("method", ["prophet exit at once", "prophet late exit", "klass", "daedal inserts",
                                    "daedal grows for the structure"])
def test_engine_equals_drop_in(llada, method):
    """The engine's tokens are the drop-in call's (one prompt at a time, as the engine decodes each request
    alone); the finish reason is `stop` where the answer holds an end token."""
    model, tok = llada
    llm = remask.LLM(model, tok)
    kw = dict(METHODS[method])
    steps = kw.pop("steps", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in (S(json=SCHEMAS["flat"]), S(choice=CHOICE)):
            sampling = remask.SamplingParams(max_tokens=32, block_length=8, structured_outputs=params,
                                             **({} if steps is None else dict(steps=steps)), **kw)
            for text, completion in zip(PROMPTS, _engine_rows(llm, PROMPTS, sampling)):
                prompt = torch.tensor([encode_chat(text)])
                ref = remask.generate(model, prompt, gen_length=32, block_length=8, structured_outputs=params,
                                      **METHODS[method])[0, prompt.shape[1]:].tolist()
                same_tokens(completion, ref, method)
                assert completion.finish_reason == "stop", (method, completion.text)


def test_without_a_structure_nothing_changes(llada):
    """`structured_outputs=None` is the method's own loop: the same tokens as not passing it (the fixtures of
    tests/test_prophet.py, test_klass.py and test_daedal.py hold them to the references)."""
    model, _ = llada
    prompt, mask = batch(PROMPTS[:2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for method in ("prophet late exit", "klass", "daedal inserts"):
            a = remask.generate(model, prompt, mask, gen_length=32, block_length=8, **METHODS[method])
            b = remask.generate(model, prompt, mask, gen_length=32, block_length=8, structured_outputs=None,
                                **METHODS[method])
            assert torch.equal(a, b) and not bool((a == MASK_ID).any()), method


def test_prophet_refuses_pinned_tokens_with_a_structure(llada):
    model, _ = llada
    prompt, mask = batch(PROMPTS[:1])
    with pytest.raises(CombinationError, match="structured_outputs.*constraints"):
        remask.generate(model, prompt, mask, gen_length=32, block_length=8, steps=32, structured_outputs=CASES[0],
                        decoder=remask.Prophet(constraints={3: 40}))
