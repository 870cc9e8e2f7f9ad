"""Forwards as data (issue 38): decoders describe each forward as a `ForwardRequest`; only the two
drivers — the drop-in `stepper.run_forwards` and the engine's `ModelRunner` — call a model. The
runner packs the requests of every running sequence into one flat forward, each request with its
own cache, mask and positions, and each gets the logits its own forward gives it."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch

import remask
from remask.diffusion.methods.margin import MarginDecoding
from remask.diffusion.parts.stepper import ForwardRequest, run_forwards
from remask.engine import LLMEngine, SamplingParams
from remask.kernels.batch_invariant import batch_invariant_linear, flat_threshold
from remask.zoo import charset, tasks

ROOT = Path(__file__).resolve().parents[1]

# A model forward written out: the model (or APD's verifier) called, its `forward`, `spec.logits`.
CALL = re.compile(r"(?<![\w.])(model|verifier|self\.model|self\.verifier)\(|\b(model|verifier|module)\.forward\(|spec\.logits\(")


def test_only_the_drivers_call_a_model():
    """No decoder in `diffusion/` calls a model: the one place is `parts/stepper.py`'s
    `call_model` (the drop-in driver, which the engine's runner shares)."""
    offenders = []
    for path in sorted((ROOT / "diffusion").rglob("*.py")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if CALL.search(code) and not code.strip().startswith(('"', "'", ">>>")):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    drivers = [o for o in offenders if o.startswith("diffusion/parts/stepper.py")]
    assert [o for o in offenders if o not in drivers] == []
    assert drivers, "the drop-in driver's call was not found: the pattern is stale"


# Every LLaDA method of docs/compatibility.md (SamplingParams keywords), blocks of 16.
LLADA_METHODS = [
    dict(block_length=16),
    dict(block_length=16, threshold=0.9),
    dict(block_length=16, threshold=0.9, use_cache="dual"),
    dict(alg="entropy"),
    dict(block_length=16, decoder=remask.FreeDave()),
    dict(block_length=16, decoder=remask.FreeDave(), use_cache="dual"),
    dict(block_length=16, decoder=remask.ThresholdDecoding()),
    dict(block_length=16, decoder=remask.CreditDecoding()),
    dict(block_length=16, decoder=remask.HierarchicalDecoding()),
    dict(block_length=16, use_cache=remask.VicinityCache()),
    dict(block_length=16, decoder=remask.WINO()),
    dict(block_length=8, decoder=remask.MultiBlock(threshold=0.1, early_stop=True)),
    dict(block_length=16, use_cache=remask.DKVCache()),
    dict(block_length=16, use_cache=remask.D2Cache()),
    dict(block_length=16, decoder=MarginDecoding()),
    dict(use_cache=remask.ElasticCache()),
]


@pytest.fixture(scope="module")
def llada():
    return remask.load("tiny-llada")


def _drop_in(model, ids, params):
    prompt = torch.tensor([ids])
    generator = torch.Generator().manual_seed(params.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if params.alg is not None:
            out = remask.diffusion_generate(model, prompt, generator=generator, **params.diffusion_generate_kwargs())
        else:
            kw = params.generate_kwargs()
            if params.decoder is not None:
                kw["decoder"] = params.decoder
            out = remask.generate(model, prompt, generator=generator, **kw)
    return out[0, len(ids):].tolist()


def test_thirty_two_requests_of_every_llada_method_share_one_model_call_per_step(llada):
    """32 requests over the LLaDA methods (prompts of different lengths, each method's own cache;
    Elastic-Cache's forwards change their rows between layers) make one model call per engine
    step, and every request gets its drop-in tokens."""
    model, tokenizer = llada
    problems = tasks.problems(32, tasks.EVAL_SEED)
    requests = [(charset.encode_chat(p.prompt), SamplingParams(max_tokens=32, seed=i, **LLADA_METHODS[i % len(LLADA_METHODS)]))
                for i, p in enumerate(problems)]
    assert len({len(ids) for ids, _ in requests}) > 3
    engine = LLMEngine(model, tokenizer, max_num_seqs=64, cost_stride=False)
    for i, (ids, params) in enumerate(requests):
        engine.add_request(str(i), ids, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        before = engine.runner.forwards
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].all_token_ids
        steps += 1
        assert engine.runner.forwards - before == 1, f"step {steps}: {engine.runner.forwards - before} model calls"
    assert steps > 4
    for i, (ids, params) in enumerate(requests):
        assert done[str(i)] == _drop_in(model, ids, params), f"request {i}: {LLADA_METHODS[i % len(LLADA_METHODS)]}"


def test_a_packed_forward_gives_each_request_its_own_logits(llada):
    """Requests of different lengths, with and without caches and masks, several rows or one, in
    one `run_forwards` call: each request's logits are bitwise those of its own forward."""
    model, _ = llada
    g = torch.Generator().manual_seed(0)
    ids = lambda n, b=1: torch.randint(0, 100, (b, n), generator=g)  # noqa: E731
    cache = remask.caches.KVCache()
    filled = ForwardRequest(ids(20), cache=cache, shared=dict(cache_position=torch.arange(20)))
    run_forwards(model, [filled])
    bias = torch.ones(1, 1, 17, 17, dtype=torch.bool)
    bias[..., 12:] = False

    def make():
        c = remask.caches.KVCache()
        c.keys, c.values = [k.clone() for k in cache.keys], [v.clone() for v in cache.values]
        return [ForwardRequest(ids(23)), ForwardRequest(ids(17), per_row=dict(attention_bias=bias)),
                ForwardRequest(ids(9, 3), rows_alone=True),
                ForwardRequest(ids(6), cache=c, shared=dict(cache_position=torch.arange(14, 20))),
                ForwardRequest(ids(31), spec=remask.get_spec(model), rows=slice(4, 20))]

    state = g.get_state()
    alone = [run_forwards(model, [r])[0] for r in make()]
    g.set_state(state)
    packed = run_forwards(model, make(), lambda rows, groups=None: batch_invariant_linear(
        True, single_thread=True, token_groups=groups))
    for a, p in zip(alone, packed):
        assert a.shape == p.shape and torch.equal(a, p)


def test_the_flat_gemm_threshold_is_measured_and_holds():
    """Where this CPU's GEMM gives every row the same bits from some row count on, rows of
    problems at least that long share one GEMM; any such row count agrees with any other."""
    weight, bias = torch.randn(96, 64), torch.randn(96)
    threshold = flat_threshold(weight, bias)
    if threshold is None:
        pytest.skip("this CPU's GEMM is not row-invariant above a size: the per-sequence GEMMs serve")
    x = torch.randn(700, 64)
    full = torch.nn.functional.linear(x, weight, bias)
    for m in (threshold, threshold + 1, 33, 129, 333, 699):
        if m >= threshold:
            assert torch.equal(torch.nn.functional.linear(x[1:1 + m], weight, bias), full[1:1 + m])


def test_the_engine_neither_probes_nor_writes_a_decoder_or_its_state():
    """One decoder protocol (`diffusion/parts/protocol.py`): the engine calls its methods, never
    `getattr` / `hasattr` on a decoder or a state, and never assigns to a decoder's state."""
    import ast

    offenders = []
    for path in sorted((ROOT / "remask" / "engine").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                    node.func.id in ("getattr", "hasattr", "setattr") and node.args:
                target = ast.unparse(node.args[0])
                if "decoder" in target or "state" in target:
                    offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
            if path.name in ("llm_engine.py", "scheduler.py") and isinstance(node, (ast.Assign, ast.AugAssign)):
                for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    text = ast.unparse(target)
                    if isinstance(target, ast.Attribute) and (text.startswith("state.") or ".state." in text):
                        offenders.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    assert offenders == []


def test_every_diffusion_decoder_the_engine_builds_is_a_decoder(llada):
    """Each LLaDA method's engine decoder implements the one protocol (no duck typing)."""
    from remask.diffusion.parts.protocol import Decoder
    from remask.engine.presets import decoder_for

    model, tokenizer = llada
    engine = LLMEngine(model, tokenizer, cost_stride=False)
    prompt = torch.tensor([charset.encode_chat("12+34")])
    for kwargs in LLADA_METHODS:
        decoder = decoder_for(engine, SamplingParams(max_tokens=16, **{**kwargs, **({"block_length": 16} if "block_length" in kwargs else {})}), prompt)
        assert isinstance(decoder, Decoder), (kwargs, type(decoder).__name__)


# Decoders are not handed the model (issue 44): what they need of it comes through its `ModelSpec` (ids,
# device, config values, embedding table, layers, an encoder-decoder model's encoder) or the answers to
# their `ForwardRequest`s. DiffusionGemma's canvas loop too: `CanvasDecoder(spec, ...)`, whose
# `models.diffusion_gemma.CanvasModel` is built from the spec.
# The drivers' own parts: `run_steps(model, steps_of, ...)` (a drop-in function's drive) and the packed
# forward's hooks on the model's layers (`varlen.PackedLayers.installed`, called by `stepper._packed`).
DRIVER_PARTS = {"run_steps", "PackedLayers.installed"}


def _takes_the_model(fn) -> list[str]:
    import inspect

    return [name for name, p in inspect.signature(fn).parameters.items()
            if name == "model" or "Module" in str(p.annotation)]


def test_no_decoder_factory_or_decoder_method_takes_the_model():
    """Every decoder and part that `diffusion/` builds (each class's methods), every step generator
    (`*_steps`) and every registered method's loop and call: none takes the model; only the drivers
    (`parts/stepper.py`'s functions, the `*_generate` entry points) do."""
    import importlib
    import inspect
    import pkgutil

    import remask.diffusion as diffusion
    from remask.diffusion.methods import registry
    from remask.models.registry import all_families, resolve

    modules = [importlib.import_module(info.name)
               for info in pkgutil.walk_packages(diffusion.__path__, "remask.diffusion.")
               if not info.ispkg and not info.name.endswith("drop_in")]
    offenders, seen = [], 0
    for module in modules:
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            if inspect.isclass(obj):
                for attr, fn in vars(obj).items():
                    if inspect.isfunction(fn) and f"{name}.{attr}" not in DRIVER_PARTS:
                        seen += 1
                        offenders += [f"{module.__name__}.{name}.{attr}({p})" for p in _takes_the_model(fn)]
            elif inspect.isfunction(obj) and name.endswith("_steps") and name not in DRIVER_PARTS:
                seen += 1
                offenders += [f"{module.__name__}.{name}({p})" for p in _takes_the_model(obj)]
    for method in registry.METHODS.values():   # the loops take the call, whose fields hold no model
        offenders += [f"{method.name}.loop({p})" for p in _takes_the_model(method.loop)]
    offenders += [f"registry.Call.{f}" for f in registry.Call.__dataclass_fields__ if f == "model"]
    # the block-causal families' engine decoders take the spec and the engine's store and stop ids, never the engine
    factories = [f.engine_decoder for f in all_families().values() if f.engine_decoder is not None]
    assert len(factories) >= 3
    for target in factories:
        parameters = list(inspect.signature(resolve(target)).parameters)
        if parameters != ["spec", "params", "store", "stop_ids"]:
            offenders.append(f"{target}{tuple(parameters)}")
    assert offenders == []
    assert seen > 200, "the decoders' methods were not found: the walk is stale"
    # the check sees what it looks for: a factory of the old form is caught
    assert _takes_the_model(lambda model, prompt: None) == ["model"]


def test_every_registered_method_decodes_from_the_spec_alone(llada):
    """Each registered method's decoder built from the model's spec alone (`decoder_steps(spec, ...)`: a
    factory that wanted the model fails on the spec), its forwards answered by a driver that holds the
    model: the drop-in call's tokens, no mask left."""
    from remask.diffusion.methods import registry
    from remask.diffusion.methods.decoders import decoder_steps, run_decoder
    from remask.diffusion.parts.stepper import drive
    from remask.models.spec import get_spec

    model, _ = llada
    spec = get_spec(model)
    prompt = torch.tensor([charset.encode_chat("12+34")])
    for method in registry.METHODS.values():
        if method.way != "method":   # a family's own loop: built from the spec by its engine_decoder (the test above)
            continue
        config = method.config()
        decoder, use_cache = (config, None) if method.field == "decoder" else (None, config)
        kw = dict(gen_length=16, block_length=16 if method.name != "multiblock" else 8, use_cache=use_cache,
                  mask_id=None, stats=None)
        steps = decoder_steps(spec, prompt, None, decoder, **kw)
        out = drive(steps, model)
        if isinstance(out, tuple):   # (x, forward counts)
            out = out[0]
        assert torch.equal(out, run_decoder(model, prompt, None, decoder, **kw)), method.name
        assert not (out[:, prompt.shape[1]:] == spec.mask_id).any(), method.name
