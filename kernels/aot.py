"""The compiled-code gate: every launched `@triton.jit` kernel compiled ahead of time for real GPUs
(sm_80, sm_90, sm_100) on a CPU-only machine, and what the compiler made of it.

What is compiled is what the launchers launch. Each *scenario* below calls a real launcher
(`unmask_triton`, `confidence_triton`, `paged_attention`, ...) on CPU tensors of the shapes remask
ships (vocabularies of LLaDA 126464, Dream 152064, LLaDA2 157184, SDAR 151936; block lengths 4 … 1024;
head dims 64/128 with the shipped models' head counts; KV blocks of 32/64, and token-level lists)
while the module's kernels are replaced by recorders; each recorded launch is specialised by
Triton's own binder for the target (argument types, which integers are 1 or divisible by 16,
16-byte-aligned pointers, constexprs, `num_warps` / `num_stages`; an argument the kernel declares
``do_not_specialize``, such as the batch-invariant GEMM's row count, stays unspecialised as it does
at run time) — so when a launcher changes its block sizes, warps or dtypes, the gate compiles the
new choice. Launchers that size by the SM count (`confidence_config`) see the target's (A100 108,
H100 132, B200 148).

`compile_one(spec, arch)` compiles one specialisation with `triton.compiler.compile` for
``GPUTarget("cuda", cap, 32)`` in a worker subprocess with a time limit (`COMPILE_TIMEOUT_S`; a
compile past it is killed with its `ptxas` and fails the gate) and returns registers, spill
stores / loads and stack frame (ptxas' ``-v`` log), Triton's shared memory, compile seconds and counts
from the SASS (`nvdisasm` of the cubin): 128-bit global loads (``LDG.E.128``), local loads / stores
(``LDL`` / ``STL``) and MMA instructions by opcode (``HMMA.*.BF16`` vs ``.TF32``, ``HGMMA``, ...).

Results are cached in `aot_results.json` (committed), each under its id with a key: sha256 of the
kernel module's source and of the kernel modules it imports jit code from, the specialisation, the
arch and the Triton version. A changed kernel source makes its entries stale and only those are
recompiled. ``python -m remask.kernels.aot --report docs/compiled-kernels.md`` recompiles what is
stale, rewrites the JSON and the markdown report; `tests/test_compiled_gate.py` asserts the gate
(compiles, no spills, compile time within budget) for every entry, known offenders listed there.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib
import io
import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from .dispatch import HAS_TRITON

HERE = Path(__file__).resolve().parent
RESULTS_PATH = HERE / "aot_results.json"
PACKAGE = __package__ or "remask.kernels"

ARCHS = {"sm80": 80, "sm90": 90, "sm100": 100}
SM_COUNT = {"sm80": 108, "sm90": 132, "sm100": 148}     # A100, H100 SXM, B200
COMPILE_TIMEOUT_S = 60
ANALYSIS_TIMEOUT_S = 120     # nvdisasm / cuobjdump after a compile
WORKER_START_TIMEOUT_S = 240
# The Triton releases the CUDA builds of the supported torch versions pin (torch 2.13 → 3.7.1,
# 2.14 → 3.8, 2.15 → 3.9): the gate's results are kept and checked for each
# (`make compiled-report-all` compiles every shipped specialisation under each of them).
SUPPORTED_TRITON = ("3.7.1", "3.8.0", "3.9.0")
# Part of every cache key: bump it when what a result holds changes (the analysis below), so the
# cached entries are recompiled.
ANALYSIS_VERSION = 1

# Modules holding launched kernels (reductions.py only has device helpers, inlined into these).
KERNEL_MODULES = ("accept", "canvas", "confidence", "dinfer", "invariant_matmul", "invariant_norm", "paged",
                  "sparse_attention", "unmask", "varlen_attention")

VOCABS = {"llada": 126464, "dream": 152064, "llada2": 157184, "sdar": 151936}
MASK_IDS = {"llada": 126336, "dream": 151666, "llada2": 156895, "sdar": 151669}
BLOCK_LENGTHS = (4, 8, 32, 64, 256, 1024)
# (Hq, H_kv, D) of the shipped models, plus a head-dim-64 configuration.
HEADS = {"llada": (32, 32, 128), "dream": (28, 4, 128), "sdar": (32, 8, 128), "d64": (32, 8, 64)}
KV_BLOCKS = (32, 64)
GEMMA_VOCAB = 262144         # DiffusionGemma (canvas kernels)
APD_ROWS = 100               # APD's default max_lookahead
SEED = 12345                 # a launch seed: neither 1 nor a multiple of 16, as a drawn seed almost always is

DTYPE_NAMES = {torch.float64: "fp64", torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


# --- specialisations -------------------------------------------------------------------------------

@dataclasses.dataclass
class Spec:
    """One compiled specialisation of one kernel for one arch."""
    module: str                  # kernels module, e.g. "unmask"
    kernel: str                  # e.g. "unmask_kernel"
    label: str                   # the scenario, e.g. "L=256,conf=fp64,rule=k"
    arch: str                    # "sm80" | "sm90" | "sm100"
    signature: dict              # arg name → Triton type ("*fp32", "i32", "constexpr", ...)
    constexprs: dict             # arg name → value
    attrs: dict                  # arg name → [["tt.divisibility", 16]]
    options: dict                # num_warps / num_stages as the launcher passes them
    aliases: list = dataclasses.field(default_factory=list)   # other scenarios with the same specialisation

    @property
    def id(self) -> str:
        return f"{self.kernel}[{self.label},{self.arch}]"

    def content(self) -> dict:
        return {"module": self.module, "kernel": self.kernel, "signature": self.signature,
                "constexprs": self.constexprs, "attrs": self.attrs, "options": self.options}

    def request(self) -> dict:
        return dict(self.content(), module=f"{PACKAGE}.{self.module}", arch=self.arch)


# (d_model, mlp hidden, vocabulary, KV projection width, qkv bias) of the models whose linear
# layers the batch-invariant GEMM runs: LLaDA-8B, Dream-7B / Qwen2.5-7B (4 KV heads of 128, q/k/v
# biases), and the tiny test checkpoints (tiny LLaDA: d 32; tiny Dream: d 32, 2 KV heads of 8;
# the 64-wide tiny models with a 300-token vocabulary).
LINEAR_MODELS = {"llada-8b": (4096, 12288, 126464, 4096, False), "dream-7b": (3584, 18944, 152064, 512, True),
                 "tiny-llada": (32, 64, 126464, 32, False), "tiny-dream": (32, 64, 300, 16, True),
                 "tiny-64": (64, 128, 300, 32, False)}
LINEAR_ROWS = 8 * 32           # rows of a scenario (8 sequences of a 32-token block); M is not specialised


class _Recorder:
    """Stands in for a kernel during a scenario: ``kernel[grid](*args, **kwargs)`` is recorded."""

    def __init__(self, name: str, fn, log: list) -> None:
        self.name, self.fn, self.log = name, fn, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.name, self.fn, args, kwargs))
        return launch


def _jit_kernels(module) -> dict:
    """The module's own `@triton.jit` functions that it launches (``name[grid](...)`` in its source)."""
    text = read_source(module.__name__.rsplit(".", 1)[1])
    return {name: value for name, value in vars(module).items()
            if hasattr(value, "fn") and callable(value.fn) and getattr(value.fn, "__module__", None) == module.__name__
            and re.search(rf"\b{name}\[", text)}


def launched_kernels() -> dict[str, set[str]]:
    """module → names of the kernels it launches (what the gate must cover)."""
    return {short: set(_jit_kernels(_module(short))) for short in KERNEL_MODULES}


def _module(short: str):
    return importlib.import_module(f"{PACKAGE}.{short}")


@contextlib.contextmanager
def _recording(arch: str) -> Iterator[list]:
    """Kernels → recorders in every kernel module; dispatchers forced to Triton; the target's SM count."""
    log: list = []
    saved = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    try:
        for short in KERNEL_MODULES:
            mod = _module(short)
            for name, kernel in _jit_kernels(mod).items():
                _UNSPECIALISED[kernel.fn] = _jit_options(kernel)
                patch(mod, name, _Recorder(name, kernel.fn, log))
            if hasattr(mod, "use_triton"):
                patch(mod, "use_triton", lambda *a, **k: True)
            if hasattr(mod, "sm_count"):
                patch(mod, "sm_count", lambda device: SM_COUNT[arch])
        yield log
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


_BINDERS: dict = {}
_UNSPECIALISED: dict = {}       # kernel function → its `do_not_specialize*` options, as `triton.jit` got them


def _jit_options(kernel) -> dict:
    """The `triton.jit(do_not_specialize=..., do_not_specialize_on_alignment=...)` a kernel was
    declared with (a compiled `JITFunction` keeps them as attributes, the interpreter's function
    in `kwargs`), so that the gate specialises its arguments as its launches are specialised."""
    found = dict(getattr(kernel, "kwargs", None) or {})
    for name in ("do_not_specialize", "do_not_specialize_on_alignment"):
        value = getattr(kernel, name, None) or found.get(name)
        found[name] = list(value) if value else None
    return {name: found[name] for name in ("do_not_specialize", "do_not_specialize_on_alignment") if found[name]}


def _specialise(fn, args, kwargs, arch: str) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) exactly as `JITFunction.run` would build them for
    `arch` from these launch arguments."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    backend = make_backend(GPUTarget("cuda", ARCHS[arch], 32))
    key = (fn, arch)
    if key not in _BINDERS:
        jf = JITFunction(fn, **_UNSPECIALISED.get(fn, {}))
        _BINDERS[key] = (jf, create_function_from_signature(jf.signature, jf.params, backend))
    jf, binder = _BINDERS[key]
    bound, specialization, options = binder(*args, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")      # Triton 3.9's FP-fusion default notice
        _, signature, constexprs, attrs = JITFunction._pack_args(jf, backend, kwargs, bound, specialization, options)
    names = jf.arg_names
    constexprs = {names[path[0]]: _plain(value) for path, value in constexprs.items()}
    attrs = {names[path[0]]: value for path, value in attrs.items() if value}
    launch_options = {k: kwargs[k] for k in ("num_warps", "num_stages", "num_ctas", "maxnreg") if k in kwargs}
    return dict(signature), constexprs, attrs, launch_options


def _plain(value):
    value = getattr(value, "value", value)       # tl.constexpr
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    raise TypeError(f"constexpr value {value!r} cannot be stored")


def _t(shape, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


# --- scenarios: the launchers on the shapes remask ships -------------------------------------------

def _unmask_scenarios():
    unmask = _module("unmask")
    for L in BLOCK_LENGTHS:
        for conf_dtype, rules in ((torch.float64, ("k", "threshold", "factor")), (torch.float32, ("k", "k+threshold"))):
            for rule in rules:
                def run(L=L, conf_dtype=conf_dtype, rule=rule):
                    B = 2
                    k = torch.ones(B, dtype=torch.long) if rule.startswith("k") else None
                    unmask.unmask_triton(_t((B, L), torch.long), _t((B, L), torch.bool), _t((B, L), torch.long),
                                         _t((B, L), conf_dtype), k=k,
                                         threshold=0.9 if "threshold" in rule else None,
                                         factor=1.0 if rule == "factor" else None)
                yield "unmask", f"L={L},conf={DTYPE_NAMES[conf_dtype]},rule={rule}", run


def _dinfer_scenarios():
    dinfer = _module("dinfer")
    for model, V in VOCABS.items():
        for dtype in (torch.bfloat16, torch.float32):
            for first in (True, False):
                def run(V=V, dtype=dtype, first=first):
                    B, L = 1, 32
                    dinfer.credit_confidence_triton(_t((B, L, V), dtype), _t((B, L, V)), _t((B, L), torch.bool),
                                                    first, 1.0, 1.0, 0.9)
                yield "dinfer", f"{model},V={V},{DTYPE_NAMES[dtype]},{'first' if first else 'later'}", run
    for L in BLOCK_LENGTHS[:3] + (64, 128) + BLOCK_LENGTHS[4:]:     # 128: dInfer's default block
        for rule in ("threshold", "hierarchy"):
            def run(L=L, rule=rule):
                x = _t((1, L), torch.long)
                dinfer.dinfer_select_triton(x, _t((1, L), torch.long), _t((1, L)), MASK_IDS["llada"], rule, 0.9,
                                            0.4 if rule == "hierarchy" else None)
            yield "dinfer", f"L={L},rule={rule}", run


def _confidence_scenarios():
    conf = _module("confidence")

    def score(model, dtype, n_rows, temperature=0.0, mode="prob"):
        V = VOCABS[model]
        conf.confidence_triton(_t((n_rows, V), dtype), temperature=temperature, mode=mode,
                               rows=torch.arange(n_rows), argmax_ids=[MASK_IDS[model]],
                               seed=SEED if temperature > 0 else None, out_dtype=torch.float64)

    for model in VOCABS:
        for dtype in (torch.bfloat16, torch.float32):
            for n_rows in (32, 512):
                yield "confidence", f"{model},V={VOCABS[model]},{DTYPE_NAMES[dtype]},rows={n_rows},prob,greedy", \
                    lambda m=model, d=dtype, n=n_rows: score(m, d, n)
        yield "confidence", f"{model},V={VOCABS[model]},bf16,rows=32,prob,sampled", \
            lambda m=model: score(m, torch.bfloat16, 32, temperature=0.7)
    for model in ("llada", "dream"):
        for mode in ("margin", "neg_entropy"):
            yield "confidence", f"{model},V={VOCABS[model]},bf16,rows=32,{mode},greedy", \
                lambda m=model, mode=mode: score(m, torch.bfloat16, 32, mode=mode)

    def tensor_parallel(model="sdar", world=2, n_rows=32):
        V = VOCABS[model]
        shard = -(-V // world)
        num_splits = conf.confidence_config(n_rows, shard, conf.sm_count(torch.device("cpu")))[2]
        part, part_idx = conf.confidence_partials_triton(
            _t((n_rows, V - shard), torch.bfloat16), vocab_start=shard, vocab_size=V, rows=torch.arange(n_rows),
            argmax_ids=[MASK_IDS[model]], num_splits=num_splits)
        conf.combine_partials_triton(_t((6, n_rows, world * num_splits)), _t((n_rows, world * num_splits), torch.int32),
                                     "prob", torch.float64)
    yield "confidence", "sdar,V=151936,bf16,rows=32,prob,greedy,tp=2", tensor_parallel


def _accept_scenarios():
    accept = _module("accept")
    V_dllm, vocab = VOCABS["dream"], 151936      # Dream drafts, a Qwen2.5 verifier

    def run(dtype, temperature):
        n = APD_ROWS
        accept.apd_accept_triton(_t(n, torch.long), _t((n, V_dllm), dtype), _t((n, vocab), dtype), 0.7, vocab=vocab,
                                 temperature=temperature, noise=_t((n, vocab)) if temperature > 0 else None)
    for dtype in (torch.bfloat16, torch.float32):
        yield "accept", f"dream+qwen,vocab={vocab},N={APD_ROWS},{DTYPE_NAMES[dtype]},greedy", \
            lambda d=dtype: run(d, 0.0)
    yield "accept", f"dream+qwen,vocab={vocab},N={APD_ROWS},bf16,sampled", lambda: run(torch.bfloat16, 0.7)


def _canvas_scenarios():
    canvas = _module("canvas")
    for dtype in (torch.float32, torch.bfloat16):
        yield "canvas", f"gemma,V={GEMMA_VOCAB},{DTYPE_NAMES[dtype]},philox", \
            lambda d=dtype: canvas.canvas_score(_t((256, GEMMA_VOCAB), d), 1.0, seed=SEED)
    for L in BLOCK_LENGTHS:
        yield "canvas", f"L={L},philox", \
            lambda L=L: canvas.canvas_update(_t((1, L), torch.long), _t((1, L)), 0.1, vocab_size=GEMMA_VOCAB, seed=SEED)
    # the engine's requests scored together, a seed each (4 canvases of 256 positions)
    seeds = torch.arange(4, dtype=torch.long)
    for dtype in (torch.float32, torch.bfloat16):
        yield "canvas", f"gemma,V={GEMMA_VOCAB},{DTYPE_NAMES[dtype]},philox,seed per request", \
            lambda d=dtype: canvas.canvas_score(_t((4 * 256, GEMMA_VOCAB), d), 1.0, seed=seeds)
    for L in BLOCK_LENGTHS:
        yield "canvas", f"L={L},philox,seed per request", \
            lambda L=L: canvas.canvas_update(_t((4, L), torch.long), _t((4, L)), 0.1, vocab_size=GEMMA_VOCAB,
                                             seed=seeds)


def _paged_scenarios():
    paged = _module("paged")

    def cache(Hkv, D, page, n_pages=64):
        return _t((n_pages, page, Hkv, D), torch.bfloat16), _t((n_pages, page, Hkv, D), torch.bfloat16)

    for model, (Hq, Hkv, D) in HEADS.items():
        def store(Hkv=Hkv, D=D):
            n = 1024
            kc, vc = cache(Hkv, D, 32)
            paged.paged_store(_t((n, Hkv, D), torch.bfloat16), _t((n, Hkv, D), torch.bfloat16), kc, vc,
                              torch.zeros(n, dtype=torch.long))
        yield "paged", f"{model},Hkv={Hkv},D={D}", store
    for model in ("llada", "dream", "sdar"):
        Hq, Hkv, D = HEADS[model]

        def gather(Hkv=Hkv, D=D):
            kc, _ = cache(Hkv, D, 32)
            paged.paged_gather(kc, torch.zeros((1, 32), dtype=torch.int32), torch.tensor([1000], dtype=torch.int32))
        yield "paged", f"{model},Hkv={Hkv},D={D},page=32", gather

    def attend(model, page, M, block_size=None, dtype=torch.bfloat16):
        Hq, Hkv, D = HEADS[model]
        kc, vc = (c.to(dtype) for c in cache(Hkv, D, page))
        q = _t((1, Hq, M, D), dtype).transpose(1, 2)           # remask/caches/paged.py's views
        k_new = _t((1, Hkv, M, D), dtype).transpose(1, 2)
        v_new = _t((1, Hkv, M, D), dtype).transpose(1, 2)
        paged.paged_attention(q, kc, vc, torch.zeros((1, 64), dtype=torch.int32),
                              torch.tensor([1000], dtype=torch.int32), k_new, v_new, block_size=block_size)
    for model in HEADS:
        for page in KV_BLOCKS:
            yield "paged", f"{model},D={HEADS[model][2]},page={page},M=32", lambda m=model, p=page: attend(m, p, 32)
    for M in (8, 256):
        yield "paged", f"sdar,D=128,page=32,M={M}", lambda M=M: attend("sdar", 32, M)
    for page in KV_BLOCKS:
        yield "paged", f"sdar,D=128,page={page},M=32,block-causal", lambda p=page: attend("sdar", p, 32, 32)
    # float32 (the reproduction dtype): float32 FMA dots (input_precision="ieee"), no TF32 MMA.
    yield "paged", "sdar,D=128,page=32,M=32,fp32", lambda: attend("sdar", 32, 32, dtype=torch.float32)
    yield "paged", "sdar,D=128,page=32,M=32,block-causal,fp32", \
        lambda: attend("sdar", 32, 32, 32, dtype=torch.float32)


def _varlen_scenarios():
    """One launch for a pack of requests (`varlen_attention`): 4 segments of a 32-token block
    (the engine's packed step) after 61 / 200 / 333 / 517 cached positions in pages of 32 or 64,
    mixed mask kinds (runtime data: bidirectional, causal, block-causal 32); q, k, v as the packed
    forward's views of `[1, H, N, D]`. Variants: no cache (a plain forward), cache only (a dual
    cache's refreshed block read from its pages), per-query masks, float32."""
    varlen = _module("varlen_attention")
    cache_lens, rows = [61, 200, 333, 517], 32

    def run(model, page=32, dtype=torch.bfloat16, cache=True, fresh=True, own_mask=False):
        Hq, Hkv, D = HEADS[model]
        S = len(cache_lens)
        N = S * rows
        q = _t((1, Hq, N, D), dtype)[0].transpose(0, 1)
        k = _t((1, Hkv, N, D), dtype)[0].transpose(0, 1) if fresh else None
        v = _t((1, Hkv, N, D), dtype)[0].transpose(0, 1) if fresh else None
        cu = torch.arange(0, N + 1, rows, dtype=torch.int32)
        kw = {}
        if cache:
            pages = -(-max(cache_lens) // page)
            kw.update(k_cache=_t((S * pages, page, Hkv, D), dtype), v_cache=_t((S * pages, page, Hkv, D), dtype),
                      block_table=torch.zeros((S, pages), dtype=torch.int32),
                      cache_lens=torch.tensor(cache_lens, dtype=torch.int32))
        if fresh:
            kw["block_sizes"] = torch.tensor([0, 1, 32, 32], dtype=torch.int32)
        if own_mask:
            kw["mask"], kw["mask_offsets"] = varlen.pack_masks(
                [torch.ones(rows, c + rows, dtype=torch.bool) for c in cache_lens])
        varlen.varlen_attention(q, k, v, cu, **kw)

    for model in HEADS:
        yield "varlen_attention", f"{model},D={HEADS[model][2]},page=32,4x32", lambda m=model: run(m)
    yield "varlen_attention", "sdar,D=128,page=64,4x32", lambda: run("sdar", page=64)
    yield "varlen_attention", "sdar,D=128,page=32,4x32,fp32", lambda: run("sdar", dtype=torch.float32)
    yield "varlen_attention", "sdar,D=128,no-cache,4x32", lambda: run("sdar", cache=False)
    yield "varlen_attention", "sdar,D=128,page=32,4x32,cache-only", lambda: run("sdar", fresh=False)
    yield "varlen_attention", "sdar,D=128,page=32,4x32,mask", lambda: run("sdar", own_mask=True)


def _sparse_scenarios():
    sparse = _module("sparse_attention")
    Lk = 1024

    def blocks(model, bs, paged=False, dtype=torch.bfloat16):
        Hq, Hkv, D = HEADS[model]
        q = _t((1, Hq, Lk, D), dtype)
        n = Lk // bs
        num = _t((1, Hq, n), torch.int32)                   # remask/caches/sparse.py's lists
        idx = _t((1, Hq, n, n), torch.int32)
        if paged:
            k, v = _t((n, bs, Hkv, D), dtype), _t((n, bs, Hkv, D), dtype)
            table = torch.zeros((1, n), dtype=torch.int32)
        else:
            k, v, table = _t((1, Hkv, Lk, D), dtype), _t((1, Hkv, Lk, D), dtype), None
        sparse.block_sparse_attention_triton(q, k, v, num, idx, q_block_size=bs, kv_block_size=bs,
                                             block_table=table, scale=D ** -0.5)

    def tokens(model, L=32, kept=512):
        Hq, Hkv, D = HEADS[model]
        q = _t((1, Hq, L, D), torch.bfloat16)
        k, v = _t((1, Hkv, Lk, D), torch.bfloat16), _t((1, Hkv, Lk, D), torch.bfloat16)
        counts = torch.full((1,), kept, dtype=torch.long)
        num = (counts + L)[:, None, None].expand(1, Hq, 1)                   # as `_index_lists` builds them
        lists = _t((1, Hkv, kept + L), torch.long)[:, :, None, :].expand(1, Hkv, Hq // Hkv, kept + L)
        lists = lists.reshape(1, Hq, 1, -1)
        sparse.block_sparse_attention_triton(q, k, v, num, lists, q_block_size=L, kv_block_size=1, scale=D ** -0.5)

    for model in ("llada", "dream", "sdar", "d64"):
        for bs in KV_BLOCKS:
            yield "sparse_attention", f"{model},D={HEADS[model][2]},block={bs}", lambda m=model, b=bs: blocks(m, b)
        yield "sparse_attention", f"{model},D={HEADS[model][2]},token-level,q=32", lambda m=model: tokens(m)
    yield "sparse_attention", "sdar,D=128,block=32,paged", lambda: blocks("sdar", 32, paged=True)
    yield "sparse_attention", "sdar,D=128,block=32,fp32", lambda: blocks("sdar", 32, dtype=torch.float32)


def _invariant_scenarios():
    """The batch-invariant GEMM on every linear layer shape of the shipped models (q, k/v, o, the
    MLP's up and down projections, the LM head), bf16 and fp32, with the biases Qwen2's q/k/v have;
    the RMSNorm at each model width. The tile depends on (N, K, dtype) only, so the big models'
    layers share a few specialisations (listed as aliases)."""
    matmul, norm = _module("invariant_matmul"), _module("invariant_norm")
    for model, (d, mlp, vocab, kv, qkv_bias) in LINEAR_MODELS.items():
        layers = {"q": (d, d, qkv_bias), "kv": (kv, d, qkv_bias), "o": (d, d, False), "up": (mlp, d, False),
                  "down": (d, mlp, False), "lm_head": (vocab, d, False)}
        for dtype in (torch.bfloat16, torch.float32):
            for layer, (N, K, bias) in layers.items():
                if layer == "kv" and kv == d and not bias:
                    continue        # the same shape as q
                def run(N=N, K=K, bias=bias, dtype=dtype):
                    matmul.invariant_linear_triton(_t((LINEAR_ROWS, K), dtype), _t((N, K), dtype),
                                                   _t(N, dtype) if bias else None)
                yield "invariant_matmul", f"{model},{layer},N={N},K={K},{DTYPE_NAMES[dtype]}" + \
                    (",bias" if bias else ""), run
            yield "invariant_norm", f"{model},D={d},{DTYPE_NAMES[dtype]}", \
                lambda d=d, dtype=dtype: norm.invariant_rms_norm_triton(_t((LINEAR_ROWS, d), dtype), _t(d, dtype), 1e-6)


SCENARIOS: tuple[Callable[[], Iterable], ...] = (
    _accept_scenarios, _canvas_scenarios, _confidence_scenarios, _dinfer_scenarios, _invariant_scenarios,
    _paged_scenarios, _sparse_scenarios, _unmask_scenarios, _varlen_scenarios)


def specs_for(arch: str) -> list[Spec]:
    """Every distinct specialisation the launchers produce on the shipped shapes, for `arch`."""
    if not HAS_TRITON:
        raise RuntimeError("the compiled-code gate needs triton")
    out: dict[tuple, Spec] = {}
    with _recording(arch) as log:
        for scenarios in SCENARIOS:
            for short, label, run in scenarios():
                log.clear()
                with torch.no_grad():
                    run()
                if not log:
                    raise RuntimeError(f"scenario {short}:{label} launched no kernel")
                for name, fn, args, kwargs in log:
                    signature, constexprs, attrs, options = _specialise(fn, args, kwargs, arch)
                    spec = Spec(short, name, label, arch, signature, constexprs, attrs, options)
                    key = (name, arch, _canonical(spec.content()))
                    if key in out:
                        if label != out[key].label and label not in out[key].aliases:
                            out[key].aliases.append(label)
                    else:
                        out[key] = spec
    ids = Counter(s.id for s in out.values())
    clashes = [i for i, n in ids.items() if n > 1]
    if clashes:
        raise RuntimeError(f"one scenario launches one kernel in two specialisations: {clashes}")
    return list(out.values())


def all_specs(archs: Iterable[str] = tuple(ARCHS)) -> list[Spec]:
    return [spec for arch in archs for spec in specs_for(arch)]


# --- cache keys ------------------------------------------------------------------------------------

def read_source(short: str) -> str:
    """The text of kernels/<short>.py (monkeypatched by the tests)."""
    return (HERE / f"{short}.py").read_text()


def _jit_dependencies(short: str) -> list[str]:
    """`short` and the kernel modules it imports `@triton.jit` code from (transitively)."""
    seen: list[str] = []
    todo = [short]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.append(name)
        for dep in re.findall(r"^\s*from \.(\w+) import", read_source(name), flags=re.M):
            if (HERE / f"{dep}.py").exists() and "@triton.jit" in read_source(dep):
                todo.append(dep)
    return sorted(seen)


def source_hash(short: str) -> str:
    h = hashlib.sha256()
    for name in _jit_dependencies(short):
        h.update(name.encode() + b"\0" + read_source(name).encode() + b"\0")
    return h.hexdigest()


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def triton_version() -> str:
    import triton
    return triton.__version__


def cache_key(spec: Spec, version: str | None = None) -> str:
    """sha256 of (kernel sources, specialisation, arch, Triton version (default: the installed one),
    `ANALYSIS_VERSION`)."""
    payload = {"source": source_hash(spec.module), "spec": spec.content(), "arch": spec.arch,
               "triton": version or triton_version(), "analysis": ANALYSIS_VERSION}
    return hashlib.sha256(_canonical(payload).encode()).hexdigest()


def load_results(path: Path = RESULTS_PATH, version: str | None = None) -> dict:
    """The stored results of one Triton version (default: the installed one): id → result."""
    if not Path(path).exists():
        return {}
    return json.loads(Path(path).read_text()).get("results", {}).get(version or triton_version(), {})


def save_results(results: dict, path: Path = RESULTS_PATH, version: str | None = None) -> None:
    """Replace one Triton version's results (default: the installed one's), keeping the others'. One
    entry per line (sorted by version, then id), so a refresh diffs line by line."""
    stored = json.loads(Path(path).read_text()).get("results", {}) if Path(path).exists() else {}
    stored[version or triton_version()] = results
    sections = []
    for v in sorted(stored, key=_version_key):
        lines = [f"  {json.dumps(k)}: {json.dumps(e, sort_keys=True)}" for k, e in sorted(stored[v].items())]
        sections.append(f" {json.dumps(v)}: {{\n" + ",\n".join(lines) + "\n }")
    text = ('{"about": "remask.kernels.aot results per Triton version: python -m remask.kernels.aot --report '
            'docs/compiled-kernels.md (make compiled-report-all: every supported version)",\n'
            '"results": {\n' + ",\n".join(sections) + "\n}}\n")
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _version_key(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else 0 for part in re.split(r"[.+]", version))


def cached(spec: Spec, results: dict, version: str | None = None) -> dict | None:
    """The stored result of `spec` if it is current for Triton `version` (default: the installed
    one): the same key, not a worker failure."""
    entry = results.get(spec.id)
    if entry is None or entry.get("infrastructure") or entry.get("key") != cache_key(spec, version):
        return None
    return entry


# --- the gate --------------------------------------------------------------------------------------

def gate_failures(result: dict, budget_s: float = COMPILE_TIMEOUT_S) -> list[str]:
    """Why `result` fails the gate (empty: it passes): it must compile, spill nothing and compile
    within `budget_s`."""
    if result.get("timed_out"):
        return [f"compile took > {budget_s:g} s (killed)"]
    if not result.get("compiled"):
        return [f"does not compile: {result.get('error', '?')}"]
    reasons = []
    stores, loads = result.get("spill_stores"), result.get("spill_loads")
    if stores is None or loads is None:
        reasons.append("no spill figures (ptxas log not parsed)")
    elif stores or loads:
        reasons.append(f"spills {_kb(stores)} stores / {_kb(loads)} loads per thread "
                       f"({result.get('stack_frame', 0)} B stack)")
    if result.get("compile_s", 0) > budget_s:
        reasons.append(f"compile took {result['compile_s']:.0f} s > {budget_s:g} s")
    return reasons


def _kb(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KB"


# --- compiling: worker subprocesses with a time limit ------------------------------------------------

def _worker_env(cache_dir: str) -> dict:
    env = dict(os.environ)
    for name in ("TRITON_INTERPRET", "REMASK_TRITON"):
        env.pop(name, None)
    env["TRITON_CACHE_DIR"] = cache_dir
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")    # Triton 3.9's default, without its warning
    return env


class _Worker:
    """One compile subprocess (its own process group, so a timeout kills its ptxas too)."""

    def __init__(self) -> None:
        self.cache_dir = tempfile.mkdtemp(prefix="remask-aot-")
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", f"{PACKAGE}.aot", "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, env=_worker_env(self.cache_dir),
                                     start_new_session=True, bufsize=0)
        self.buffer = b""
        ready = self._read(WORKER_START_TIMEOUT_S)
        if ready is None or not ready.get("ready"):
            err = self._stderr_tail()
            self.close()
            raise RuntimeError(f"compile worker did not start: {err}")

    def _read(self, timeout: float) -> dict | None:
        """The worker's next line (JSON), or None on timeout or end of output."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def _stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-2000:]

    def compile(self, request: dict, budget_s: float, grace_s: float = 5.0) -> dict:
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        started = time.perf_counter()
        first = self._read(budget_s + grace_s)      # {"compiled": ...} right after triton's compile
        if first is None:
            waited = time.perf_counter() - started
            alive = self.proc.poll() is None
            self.close()
            if alive:
                return {"compiled": False, "timed_out": True, "compile_s": round(waited, 1)}
            return {"compiled": False, "error": f"worker died: {self._stderr_tail()[-300:]}"}
        if "result" in first:                      # failed before a compile finished
            return first["result"]
        result = self._read(ANALYSIS_TIMEOUT_S)
        if result is None:
            self.close()
            return dict(first, analysed=False, error="SASS analysis timed out")
        return result["result"]

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=30)
        shutil.rmtree(self.cache_dir, ignore_errors=True)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


def compile_many(specs: list[Spec], jobs: int = 1, budget_s: float = COMPILE_TIMEOUT_S,
                 on_result: Callable[[Spec, dict], None] | None = None, grace_s: float = 5.0) -> dict[str, dict]:
    """Compile `specs` on `jobs` workers; returns id → result (see `compile_one`). A compile still
    running `grace_s` after `budget_s` is killed (with its ptxas) and reported as timed out."""
    todo: queue.Queue = queue.Queue()
    for spec in specs:
        todo.put(spec)
    out: dict[str, dict] = {}
    lock = threading.Lock()
    n_jobs = max(1, min(jobs, len(specs)))

    def work():
        worker = None
        try:
            while True:
                try:
                    spec = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    if worker is None or not worker.alive:
                        worker = _Worker()
                    result = worker.compile(spec.request(), budget_s, grace_s)
                except Exception as e:  # noqa: BLE001 - a broken worker fails this spec, not the run
                    if worker is not None:
                        worker.close()
                    worker = None
                    result = {"compiled": False, "error": f"{type(e).__name__}: {e}"[:500], "infrastructure": True}
                result = _finish(spec, dict(result, parallel=n_jobs), budget_s)
                with lock:
                    out[spec.id] = result
                    if on_result is not None:
                        on_result(spec, result)
        finally:
            if worker is not None:
                worker.close()

    threads = [threading.Thread(target=work, daemon=True) for _ in range(n_jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _finish(spec: Spec, result: dict, budget_s: float) -> dict:
    result = dict(result, id=spec.id, key=cache_key(spec), module=spec.module, kernel=spec.kernel,
                  label=spec.label, arch=spec.arch, aliases=list(spec.aliases), triton=triton_version(),
                  constexprs=spec.constexprs, options=spec.options)
    result["failures"] = gate_failures(result, budget_s)
    result["passed"] = not result["failures"]
    return result


def compile_one(spec: Spec, arch: str | None = None, budget_s: float = COMPILE_TIMEOUT_S) -> dict:
    """Compile one specialisation (for `arch`, default the spec's) in a fresh worker with the time
    limit; returns registers, spill_stores / spill_loads / stack_frame (bytes per thread), shared
    (bytes), compile_s, ldg128, ldl, stl, mma ({opcode: count}), mma_kinds ({"HMMA.BF16": n, ...}),
    num_warps, num_stages, and the gate's verdict (passed, failures)."""
    if arch is not None and arch != spec.arch:
        spec = dataclasses.replace(spec, arch=arch)
    return compile_many([spec], jobs=1, budget_s=budget_s)[spec.id]


# --- inside the worker -----------------------------------------------------------------------------

_PTXAS_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_RES_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_SASS_OP = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Za-z0-9_]+)*)", re.M)
_MMA_TYPES = ("BF16", "F16", "TF32", "E4M3", "E5M2", "F8F6F4", "S8", "U8", "F64")


def sass_counts(sass: str, ptx: str = "") -> dict:
    """Counts from `nvdisasm` text: 128-bit global loads, local loads / stores, MMA opcodes. The
    operand type of an MMA is in its SASS opcode (``HMMA.16816.F32.BF16``, ``HGMMA.64x64x8.F32.TF32``)
    except for sm_100's tcgen05 ``UTC*MMA``, whose kind the PTX names (``tcgen05.mma...kind::tf32``)."""
    ops = Counter(_SASS_OP.findall(sass))
    mma = {op: n for op, n in sorted(ops.items()) if "MMA" in op.split(".")[0]}
    tcgen05 = sorted({k.upper() for k in re.findall(r"tcgen05\.mma\S*?kind::(\w+)", ptx)})
    kinds: Counter = Counter()
    for op, n in mma.items():
        parts = op.split(".")
        kind = next((t for t in _MMA_TYPES if t in parts[1:]), None)
        if kind is None:
            kind = "/".join(tcgen05) if parts[0].startswith("UTC") and tcgen05 else "?"
        kinds[f"{parts[0]}.{kind}"] += n
    return {
        "instructions": sum(ops.values()),
        "ldg128": sum(n for op, n in ops.items() if op.startswith("LDG") and ".128" in op),
        "ldg": sum(n for op, n in ops.items() if op.startswith("LDG")),
        "ldl": sum(n for op, n in ops.items() if op.split(".")[0] == "LDL"),
        "stl": sum(n for op, n in ops.items() if op.split(".")[0] == "STL"),
        "mma": mma,
        "mma_kinds": dict(sorted(kinds.items())),
    }


def _tool(name: str) -> str:
    from triton import knobs
    return getattr(knobs.nvidia, name).path


def _analyse(cubin: bytes, ptxas_log: str, ptx: str = "") -> dict:
    out: dict = {}
    m = _PTXAS_SPILLS.search(ptxas_log)
    if m:
        out.update(stack_frame=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3)))
    m = _PTXAS_REGS.search(ptxas_log)
    if m:
        out["registers"] = int(m.group(1))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
        m = _RES_USAGE.search(usage)
        if m:
            out.setdefault("registers", int(m.group(1)))
            out["local_bytes"] = int(m.group(4))
            out.setdefault("stack_frame", int(m.group(2)))
        sass = subprocess.run([_tool("nvdisasm"), "-c", "-ndf", f.name], capture_output=True, text=True).stdout
    out.update(sass_counts(sass, ptx))
    return out


def _worker_compile(request: dict, emit: Callable[[dict], None]) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as tcompile

    try:
        fn = getattr(importlib.import_module(request["module"]), request["kernel"])
        attrs = {(fn.arg_names.index(name),): value for name, value in request["attrs"].items()}
        src = ASTSource(fn, request["signature"], request["constexprs"], attrs)
    except Exception as e:  # noqa: BLE001 - reported as the gate's failure
        return {"compiled": False, "error": f"{type(e).__name__}: {e}"[:500]}
    log = io.StringIO()
    started = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            kernel = tcompile(src, target=GPUTarget("cuda", ARCHS[request["arch"]], 32), options=request["options"])
    except Exception as e:  # noqa: BLE001
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return {"compiled": False, "compile_s": round(time.perf_counter() - started, 2),
                "error": f"{type(e).__name__}: {first}"[:500]}
    compile_s = round(time.perf_counter() - started, 2)
    emit({"compiled": True, "compile_s": compile_s})
    md = kernel.metadata
    result = {"compiled": True, "compile_s": compile_s, "shared": md.shared, "num_warps": md.num_warps,
              "num_stages": md.num_stages}
    result.update(_analyse(kernel.asm["cubin"], log.getvalue(), kernel.asm.get("ptx", "")))
    return result


def _worker_main() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)            # stray prints (Triton prints failing PTX) never reach the channel
    sys.stdout = open(os.devnull, "w")

    def emit(obj):
        channel.write(json.dumps(obj) + "\n")
        channel.flush()

    from triton import knobs
    knobs.nvidia.dump_ptxas_log = True       # ptxas -v output, printed (captured per compile)
    knobs.compilation.always_compile = True
    for short in KERNEL_MODULES:
        _module(short)
    emit({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        result = _worker_compile(request, emit)
        emit({"result": result})


# --- the report ------------------------------------------------------------------------------------

def refresh(specs: list[Spec], results: dict, jobs: int = 1, force: bool = False,
            budget_s: float = COMPILE_TIMEOUT_S, verbose: bool = True) -> tuple[dict, list[Spec]]:
    """Recompile the stale (or all, `force`) specs; returns the updated results and what was compiled."""
    stale = [s for s in specs if force or cached(s, results) is None]
    done = [0]

    def progress(spec, result):
        done[0] += 1
        if verbose:
            verdict = "ok" if result["passed"] else "FAIL: " + "; ".join(result["failures"])
            print(f"[{done[0]}/{len(stale)}] {spec.id}: {result.get('compile_s', '?')} s, "
                  f"{result.get('registers', '?')} regs — {verdict}", flush=True)
    fresh = compile_many(stale, jobs=jobs, budget_s=budget_s, on_result=progress)
    results = dict(results)
    results.update(fresh)
    return results, stale


def _fmt_mma(result: dict) -> str:
    kinds = result.get("mma_kinds") or {}
    return ", ".join(f"{k} ×{n}" for k, n in kinds.items()) or "–"


def load_all_results(path: Path = RESULTS_PATH) -> dict[str, dict]:
    """Triton version → its stored results."""
    return json.loads(Path(path).read_text()).get("results", {}) if Path(path).exists() else {}


def version_rows(specs: list[Spec], by_version: dict[str, dict]) -> list[str]:
    """The summary per Triton version: how many of today's specialisations it holds current results
    for, how many pass, the worst registers and spills, the compile time."""
    lines = ["| Triton | supported | current results | pass | fail | max regs | spills (st / ld, B) | compile s |",
             "|---|---|---|---|---|---|---|---|"]
    for version in sorted(set(by_version) | set(SUPPORTED_TRITON), key=_version_key):
        rows = [e for s in specs if (e := cached(s, by_version.get(version, {}), version)) is not None]
        passed = sum(r["passed"] for r in rows)
        regs = max((r.get("registers") or 0 for r in rows), default=0)
        st = sum(r.get("spill_stores") or 0 for r in rows)
        ld = sum(r.get("spill_loads") or 0 for r in rows)
        secs = sum(r.get("compile_s") or 0 for r in rows)
        lines.append(f"| {version} | {'yes' if version in SUPPORTED_TRITON else 'no'} | {len(rows)} / {len(specs)} | "
                     f"{passed} | {len(rows) - passed} | {regs} | {st} / {ld} | {secs:.0f} |")
    return lines


def write_report(path: Path, specs: list[Spec], results: dict, by_version: dict[str, dict] | None = None) -> None:
    order = {m: i for i, m in enumerate(KERNEL_MODULES)}
    rows = sorted((results[s.id] for s in specs if s.id in results),
                  key=lambda r: (order.get(r["module"], 99), r["kernel"], r["label"], ARCHS[r["arch"]]))
    failing = [r for r in rows if not r["passed"]]
    parallel = sorted({r.get("parallel", 1) for r in rows})
    total_s = sum(r.get("compile_s") or 0 for r in rows)
    lines = [
        "# Compiled kernels",
        "",
        "Generated by `python -m remask.kernels.aot --report docs/compiled-kernels.md` (`make compiled-report`);",
        "do not edit. Every launched `@triton.jit` kernel, in the specialisations its launcher produces on",
        "the shapes remask ships, compiled ahead of time with Triton "
        f"{triton_version()} for sm_80, sm_90 and sm_100 on a",
        "CPU-only machine (`kernels/aot.py`); the gate (`tests/test_compiled_gate.py`) requires: it",
        f"compiles, spills nothing, and compiles within {COMPILE_TIMEOUT_S} s.",
        "",
        "Columns: registers per thread and spill stores / loads (bytes per thread) from `ptxas -v`;",
        "smem = the shared memory Triton allocates (bytes); compile s = `triton.compiler.compile` wall time",
        "on the machine that made the report (a 2-core CPU box, "
        f"{' or '.join(map(str, parallel))} compile(s) at a time); LDG.128 /",
        "LDL / STL / MMA = instruction counts in the SASS (`nvdisasm`). Ids are",
        "`kernel[scenario,arch]`; a scenario's other names with the same specialisation are listed below.",
        "",
        f"**{len(rows)} compiled specialisations, {len(rows) - len(failing)} pass, {len(failing)} fail.** "
        f"Compile time, all together: {total_s:.0f} s (timeouts counted at the limit).",
        "",
        "## Every supported Triton version",
        "",
        "The CUDA builds of the supported torch versions pin different Triton releases (torch 2.13 → 3.7.1,",
        "2.14 → 3.8, 2.15 → 3.9), so every shipped specialisation is compiled under each",
        "(`make compiled-report-all`; `tests/test_compiled_gate.py` checks each version's results are",
        "current and fail only as recorded there, `KNOWN_BY_VERSION`). The tables below this one are the",
        "installed version's.",
        "",
        *version_rows(specs, by_version if by_version is not None else {triton_version(): results}),
        "",
    ]
    if failing:
        lines += ["## Offenders", "", "| id | registers | spills (st / ld) | compile s | reason |",
                  "|---|---|---|---|---|"]
        for r in failing:
            lines.append(f"| `{r['id']}` | {r.get('registers', '–')} | {_spills(r)} | {_secs(r)} | "
                         f"{'; '.join(r['failures'])} |")
        lines.append("")
    lines += ["## All specialisations", "",
              "| kernel | specialisation | arch | regs | spills st / ld (B) | smem (B) | compile s | LDG.128 | "
              "LDL / STL | MMA | gate |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        gate = "pass" if r["passed"] else "**FAIL**: " + "; ".join(r["failures"])
        lines.append(f"| `{r['kernel']}` | {r['label']} | {r['arch']} | {r.get('registers', '–')} | {_spills(r)} | "
                     f"{r.get('shared', '–')} | {_secs(r)} | {r.get('ldg128', '–')} | "
                     f"{r.get('ldl', '–')} / {r.get('stl', '–')} | {_fmt_mma(r)} | {gate} |")
    aliased: dict = {}
    for r in rows:
        if r.get("aliases"):
            aliased.setdefault((r["kernel"], r["label"], tuple(r["aliases"])), []).append(r["arch"])
    if aliased:
        lines += ["", "## Same specialisation, other scenarios", ""]
        for (kernel, label, aliases), archs in aliased.items():
            lines.append(f"* `{kernel}[{label}]` ({', '.join(archs)}) also: " + "; ".join(aliases))
    Path(path).write_text("\n".join(lines) + "\n")


def _spills(r: dict) -> str:
    if r.get("spill_stores") is None:
        return "–"
    return f"{r['spill_stores']} / {r['spill_loads']}"


def _secs(r: dict) -> str:
    if r.get("timed_out"):
        return f"> {COMPILE_TIMEOUT_S}"
    return f"{r['compile_s']:.1f}" if r.get("compile_s") is not None else "–"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remask.kernels.aot", description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help="write the markdown report here")
    parser.add_argument("--results", type=Path, default=RESULTS_PATH, help="the JSON cache (default: %(default)s)")
    parser.add_argument("--arch", action="append", choices=sorted(ARCHS), help="only these archs (repeatable)")
    parser.add_argument("--jobs", type=int, default=1, help="compiles in parallel (default 1: honest timings)")
    parser.add_argument("--force", action="store_true", help="recompile everything")
    parser.add_argument("--budget", type=float, default=COMPILE_TIMEOUT_S, help="compile time limit, s")
    args = parser.parse_args(argv)
    if args.worker:
        _worker_main()
        return 0
    started = time.perf_counter()
    archs = args.arch or list(ARCHS)
    specs = all_specs(archs)
    results, stale = refresh(specs, load_results(args.results), jobs=args.jobs, force=args.force,
                             budget_s=args.budget)
    # Entries no launcher produces any more are dropped (only when every arch was derived: a
    # partial run keeps the others').
    if args.arch is None:
        current = {s.id for s in specs}
        results = {k: v for k, v in results.items() if k in current}
    save_results(results, args.results)
    wall = time.perf_counter() - started
    failing = [results[s.id] for s in specs if not results[s.id]["passed"]]
    print(f"{len(specs)} specialisations, {len(stale)} compiled now, {len(failing)} failing the gate; "
          f"{wall:.0f} s")
    for r in failing:
        print(f"  {r['id']}: {'; '.join(r['failures'])}")
    if args.report:
        write_report(args.report, specs, results, load_all_results(args.results))
        print(f"wrote {args.report}")
    return 0


# A deliberately spilling kernel: the gate's self-test (`tests/test_compiled_gate.py`). One warp
# loads two float32 tiles of BLOCK values (BLOCK/32 per thread each) that stay live across a
# reduction of their product: at BLOCK = 4096, 256 values per thread, more than the 255 registers.
if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def spill_probe_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs)
        w = tl.load(x_ptr + BLOCK + offs)
        s = tl.sum(x * w, axis=0)
        tl.store(out_ptr + offs, x * s + w)


def spill_probe_spec(arch: str = "sm90", block: int = 4096) -> Spec:
    return Spec("aot", "spill_probe_kernel", f"BLOCK={block},warps=1", arch,
                {"x_ptr": "*fp32", "out_ptr": "*fp32", "BLOCK": "constexpr"}, {"BLOCK": block},
                {"x_ptr": [["tt.divisibility", 16]], "out_ptr": [["tt.divisibility", 16]]}, {"num_warps": 1})


if __name__ == "__main__":
    sys.exit(main())
