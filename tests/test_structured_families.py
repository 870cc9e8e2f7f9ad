"""Structured output in the decoders with loops of their own (diffusion/parts/constrain_loops.py):
SDAR, LLaDA2 (2.0, 2.1's edits, FreeDave, a dInfer rule), Fast-dLLM v2 (and FreeDave), APD and
DiffusionGemma's canvases, on the tiny checkpoints their own tests build, with the zoo's character
tokenizer (it spells JSON; ids it lacks are banned inside a structure, the families' end ids allowed
where it is complete). Every output that ends with an end id parses and validates (`jsonschema`),
every other is a valid prefix, no mask token is returned, and the engine's tokens are the drop-in
call's. Each family's `stop` share is printed (`-s`) and asserted > 0."""
from __future__ import annotations

import json
import re
import warnings

import pytest
import torch

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

import remask  # noqa: E402
from remask.models import tiny  # noqa: E402
from remask.structured import StructuredOutputsParams as S, compile_structure  # noqa: E402
from remask.zoo import charset  # noqa: E402

SCHEMAS = [
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"],
     "additionalProperties": False},
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 4},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 99}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                               "required": ["ok"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z][0-9]$"}}, "required": ["code"],
     "additionalProperties": False},
]
CASES = [S(json=s) for s in SCHEMAS] + [S(regex=r"[a-z]{2,3}-[0-9]"), S(choice=["yes", "no", "maybe"])]
MASK = 299          # the tiny block-causal checkpoints' mask id (vocabulary 300, EOS 298)
SHARES: dict[str, tuple[int, int]] = {}


@pytest.fixture(scope="module")
def tok():
    return charset.build_tokenizer()


def check_rows(name: str, rows: list[list[int]], params: S, tok, end_ids, mask_id: int | None) -> tuple[int, int]:
    """Each row: no mask; a valid prefix; complete (validates) where it holds an end id. Returns (stops, total)."""
    matcher = compile_structure(params, tok, 300, () if mask_id is None else (mask_id,)).matcher(end_ids)
    stops = 0
    for row in rows:
        assert mask_id is None or mask_id not in row, (name, row)
        assert matcher.accepts(row) == len(row), (name, row)
        ends = [i for i, t in enumerate(row) if t in end_ids]
        if ends:
            stops += 1
            text = tok.decode(row[:ends[0]])
            if params.json is not None:
                jsonschema.validate(json.loads(text), params.json)
            elif params.regex is not None:
                assert re.fullmatch(params.regex, text), text
            else:
                assert text in params.choice, text
    return stops, len(rows)


def tally(name: str, counts: list[tuple[int, int]]) -> None:
    stops, total = sum(c[0] for c in counts), sum(c[1] for c in counts)
    SHARES[name] = (stops, total)
    print(f"\n[structured] {name}: {stops}/{total} finished with stop")
    assert stops > 0, f"{name}: no answer finished with stop"


def engine_rows(model, tok, prompts, params):
    llm = remask.LLM(model, tok)
    return llm, [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


# ---- SDAR -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("sdar")
    tiny.write_tiny_sdar(str(path), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(path)).eval()


@pytest.mark.parametrize("variant", ["default", "sampled", "freedave", "rule"])
def test_sdar(sdar, tok, variant):
    from remask.compat.sdar import block_diffusion_generate

    ends = [charset.EOS_ID, charset.EOT_ID, 298]
    kw = dict(gen_length=32, block_length=4, denoising_steps=4, temperature=0.0,
              remasking_strategy="low_confidence_static")
    if variant == "sampled":
        kw.update(temperature=1.0, remasking_strategy="low_confidence_dynamic", denoising_steps=2)
    elif variant == "freedave":
        kw.update(decoder=remask.FreeDave(draft_steps=3))
    elif variant == "rule":
        kw = dict(gen_length=32, block_length=4, temperature=0.0, decoder=remask.ThresholdDecoding(threshold=0.9))
    counts = []
    for params in CASES:
        rows = []
        for seed, prompt in enumerate(([5, 17, 42, 9], [9, 8, 7, 6, 5, 4])):
            x = block_diffusion_generate(sdar, {"input_ids": torch.tensor([prompt])}, MASK, stopping_criteria_idx=ends,
                                         structured_outputs=params, tokenizer=tok,
                                         generator=torch.Generator().manual_seed(seed), **kw)
            rows.append(x[0, len(prompt):len(prompt) + 32].tolist())
        counts.append(check_rows("sdar", rows, params, tok, ends, MASK))
    tally(f"sdar {variant}", counts)


def test_sdar_engine_equals_drop_in(sdar, tok):
    from remask.compat.sdar import block_diffusion_generate

    prompts = [[5, 17, 42, 9], [9, 8, 7, 6, 5, 4]]
    for params in (CASES[0], CASES[2], CASES[-1]):
        sp = remask.SamplingParams(max_tokens=24, structured_outputs=params,
                                   decoder=remask.SDARDecoding(block_length=4, denoising_steps=4))
        llm, outs = engine_rows(sdar, tok, prompts, sp)
        for prompt, out in zip(prompts, outs):
            x = block_diffusion_generate(sdar, {"input_ids": torch.tensor([prompt])}, MASK, gen_length=24,
                                         block_length=4, denoising_steps=4, temperature=0.0,
                                         remasking_strategy="low_confidence_static",
                                         stopping_criteria_idx=sorted(llm.engine.stop_ids),
                                         structured_outputs=params, tokenizer=tok)
            ref = x[0, len(prompt):len(prompt) + 24].tolist()
            assert out.all_token_ids == ref[:len(out.all_token_ids)]
            assert out.finish_reason in ("stop", "length")
            if out.finish_reason == "stop":
                check_answer_text(out.text, params)


def check_answer_text(text: str, params: S) -> None:
    if params.json is not None:
        jsonschema.validate(json.loads(text), params.json)
    elif params.regex is not None:
        assert re.fullmatch(params.regex, text), text
    else:
        assert text in params.choice, text


# ---- LLaDA2 ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def llada2(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("llada2")
    tiny.write_tiny_llada2(str(path), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(path)).eval()


@pytest.mark.parametrize("variant", ["2.0", "2.1_edits", "freedave", "rule"])
def test_llada2(llada2, tok, variant):
    from remask.compat.llada2 import generate

    eos = 298
    kw = dict(gen_length=32, block_length=4, steps=4, threshold=0.9)
    if variant == "2.1_edits":
        kw.update(editing_threshold=0.5, max_post_steps=4, eos_early_stop=True)
    elif variant == "freedave":
        kw.update(threshold=1.0, decoder=remask.FreeDave(draft_steps=3))
    elif variant == "rule":
        kw = dict(gen_length=32, block_length=4, decoder=remask.ThresholdDecoding(threshold=0.9))
    counts = []
    for params in CASES:
        rows = []
        for prompt in ([5, 17, 42, 9], [9, 8, 7, 6, 5, 4]):
            out = generate(llada2, torch.tensor([prompt]), eos_id=eos, mask_id=MASK, structured_outputs=params,
                           tokenizer=tok, **kw)
            rows.append(out[0].tolist())
        counts.append(check_rows("llada2", rows, params, tok, [eos], MASK))
    tally(f"llada2 {variant}", counts)


def test_llada2_engine_equals_drop_in(llada2, tok):
    from remask.compat.llada2 import generate

    prompts = [[5, 17, 42, 9], [9, 8, 7, 6, 5, 4]]
    for params in (CASES[0], CASES[-2]):
        sp = remask.SamplingParams(max_tokens=24, structured_outputs=params, threshold=0.9,
                                   decoder=remask.LLaDA2Decoding(block_length=4, steps=4))
        llm, outs = engine_rows(llada2, tok, prompts, sp)
        for prompt, out in zip(prompts, outs):
            ref = generate(llada2, torch.tensor([prompt]), gen_length=24, block_length=4, steps=4, threshold=0.9,
                           eos_id=llm.engine.spec.eos_id, mask_id=MASK, structured_outputs=params, tokenizer=tok)
            assert out.all_token_ids == ref[0].tolist()[:len(out.all_token_ids)]
            if out.finish_reason == "stop":
                check_answer_text(out.text, params)


# ---- Fast-dLLM v2 ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("fast_dllm_v2")
    tiny.write_tiny_fast_dllm_v2(str(path), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(path)).eval()


@pytest.mark.parametrize("variant", ["default", "block_cache", "freedave"])
def test_fast_dllm_v2(fast, tok, variant):
    from remask.compat.fast_dllm_v2 import generate

    stop = 298
    kw = dict(max_new_tokens=32, block_size=8, small_block_size=4, threshold=0.9, mask_id=MASK, stop_token=stop)
    if variant == "block_cache":
        kw.update(use_block_cache=True)
    elif variant == "freedave":
        kw.update(threshold=1.0, decoder=remask.FreeDave(draft_steps=3))
    counts = []
    for params in CASES:
        rows = []
        for prompt in ([5, 17, 42, 9], [9, 8, 7, 6, 5, 4, 3, 2]):
            out = generate(fast, torch.tensor([prompt]), tokenizer=tok, structured_outputs=params, **kw)
            rows.append(out[0, len(prompt):].tolist())
        counts.append(check_rows("fast_dllm_v2", rows, params, tok, [stop], MASK))
    tally(f"fast_dllm_v2 {variant}", counts)


def test_fast_dllm_v2_engine_equals_drop_in(fast, tok):
    from remask.compat.fast_dllm_v2 import generate

    prompts = [[5, 17, 42, 9], [9, 8, 7, 6, 5, 4, 3, 2]]
    for params in (CASES[0], CASES[-1]):
        sp = remask.SamplingParams(max_tokens=24, structured_outputs=params, threshold=0.9,
                                   decoder=remask.FastDLLMV2Decoding(block_size=8, small_block_size=4))
        llm, outs = engine_rows(fast, tok, prompts, sp)
        for prompt, out in zip(prompts, outs):
            ref = generate(fast, torch.tensor([prompt]), max_new_tokens=24, block_size=8, small_block_size=4,
                           threshold=0.9, mask_id=MASK, stop_token=llm.engine.spec.eos_id, tokenizer=tok,
                           structured_outputs=params)
            assert out.all_token_ids == ref[0, len(prompt):].tolist()[:len(out.all_token_ids)]
            if out.finish_reason == "stop":
                check_answer_text(out.text, params)


# ---- APD ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pair():
    llada, llada_tok = remask.load("tiny-llada")
    return llada, remask.load("tiny-ar")[0], llada_tok


@pytest.mark.parametrize("variant", ["greedy", "sampled", "coupled"])
def test_apd(pair, variant):
    from remask.diffusion.families.apd import APDConfig

    model, verifier, tok = pair
    apd = APDConfig(verifier=verifier, mixture_weight=0.7, kv_window=16, max_lookahead=16,
                    coupled_gumbel=variant == "coupled")
    temperature = 0.0 if variant == "greedy" else 1.0
    counts = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in CASES:
            rows = []
            for seed, text in enumerate(("colour of grass", "sort 3 1 2")):
                prompt = torch.tensor([charset.encode_chat(text)])
                out = remask.generate(model, prompt, gen_length=32, apd=apd, temperature=temperature,
                                      generator=torch.Generator().manual_seed(seed), structured_outputs=params,
                                      tokenizer=tok)
                rows.append(out[0, prompt.shape[1]:].tolist())
            counts.append(check_rows("apd", rows, params, tok, [charset.EOS_ID], charset.MASK_ID))
    tally(f"apd {variant}", counts)


def test_apd_engine_equals_drop_in(pair):
    from remask.diffusion.families.apd import APDConfig

    model, verifier, tok = pair
    apd = APDConfig(verifier=verifier, mixture_weight=0.7, kv_window=16, max_lookahead=16)
    llm = remask.LLM(model, tok)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for params in (CASES[0], CASES[-1]):
            prompt = charset.encode_chat("colour of grass")
            out = llm.generate([prompt], remask.SamplingParams(max_tokens=32, decoder=apd, structured_outputs=params),
                               use_tqdm=False)[0].outputs[0]
            ref = remask.generate(model, torch.tensor([prompt]), gen_length=32, apd=apd, structured_outputs=params,
                                  tokenizer=tok)
            assert out.all_token_ids == ref[0, len(prompt):].tolist()[:len(out.all_token_ids)]
            if out.finish_reason == "stop":
                check_answer_text(out.text, params)


# ---- DiffusionGemma -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
        pytest.skip("DiffusionGemma needs transformers >= 5.11")
    from transformers import AutoModelForImageTextToText

    path = tmp_path_factory.mktemp("diffusion_gemma")
    tiny.write_tiny_diffusion_gemma(str(path), seed=1, charset=charset, canvas_length=8,
                                    generation={"max_denoising_steps": 6})
    return AutoModelForImageTextToText.from_pretrained(str(path)).eval(), str(path)


@pytest.mark.parametrize("variant", ["default", "threshold"])
def test_diffusion_gemma(gemma, tok, variant):
    model, _ = gemma
    kw = {}
    if variant == "threshold":
        from remask.diffusion.families.canvas import CanvasSampler

        kw = dict(canvas_sampler=CanvasSampler(rule="threshold", threshold=0.5))
    counts = []
    for params in CASES:
        rows = []
        for seed, text in enumerate(("colour of grass", "sort 3 1 2")):
            prompt = torch.tensor([charset.encode_chat(text)])
            out = remask.diffusion_generate(model, prompt, max_new_tokens=32, structured_outputs=params,
                                            tokenizer=tok, generator=torch.Generator().manual_seed(seed),
                                            return_dict_in_generate=False, **kw)
            row = out[0, prompt.shape[1]:].tolist()
            if charset.EOS_ID in row:   # pad after the first EOS (transformers' finalisation)
                row = row[:row.index(charset.EOS_ID) + 1]
            rows.append(row)
        counts.append(check_rows("diffusion_gemma", rows, params, tok, [charset.EOS_ID], None))
    tally(f"diffusion_gemma {variant}", counts)


def test_diffusion_gemma_engine_equals_drop_in(gemma, tok):
    model, path = gemma
    llm = remask.LLM(model, tok)
    for params in (CASES[0], CASES[-1]):
        prompt = charset.encode_chat("colour of grass")
        out = llm.generate([prompt], remask.SamplingParams(max_tokens=24, seed=4, structured_outputs=params),
                           use_tqdm=False)[0].outputs[0]
        ref = remask.diffusion_generate(model, torch.tensor([prompt]), max_new_tokens=24, structured_outputs=params,
                                        tokenizer=tok, generator=torch.Generator().manual_seed(4),
                                        return_dict_in_generate=False)
        assert out.all_token_ids == ref[0, len(prompt):].tolist()[:len(out.all_token_ids)]
        if out.finish_reason == "stop":
            check_answer_text(out.text, params)
