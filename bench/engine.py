"""Offline engine benchmark: `remask.LLMEngine` against sequential `remask.generate` /
`remask.ar_generate` / `remask.diffusion_generate` calls in the same run, on the shipped tiny models.

    python bench/engine.py --out bench/results/engine-<machine>-<date>.md

For 1…256 requests (held-out problems: mixed prompt lengths) with mixed settings — LLaDA
low-confidence, Fast-dLLM threshold and factor, seeded sampling, the dual and prefix caches; Dream's
sampler (entropy, maskgit_plus, confidence_threshold, origin); and tiny-ar greedy / sampled — all submitted at t = 0, it reports generated tokens/s, requests/s,
NFE per generated token, p50/p99 latency (from t = 0; sequential: when its call returns), model
forwards, and whether every request's tokens are identical to its sequential call's. Rows for the
engine with `batch_invariant=False` show what invariance costs. One intra-op thread by default
(the tests' setting; `--threads` changes the sequential calls' and the unbatched forwards').
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from typing import Any

import torch

import remask
from remask.diffusion.methods.margin import MarginDecoding
from remask.engine import LLMEngine, SamplingParams
from remask.zoo import charset, tasks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)

LLADA_MIX = [
    ("low_confidence", dict(steps=16, block_length=8)),
    ("threshold 0.9", dict(steps=16, block_length=8, threshold=0.9)),
    ("factor 1.0", dict(steps=16, block_length=4, factor=1.0)),
    ("T=0.7", dict(steps=16, block_length=8, temperature=0.7)),
    ("dual cache + threshold", dict(steps=16, block_length=8, threshold=0.9, use_cache="dual")),
    ("prefix cache", dict(steps=16, block_length=8, use_cache="prefix")),
]
UNCACHED_MIX = LLADA_MIX[:4]
DREAM_MIX = [  # Dream's sampler (diffusion_generate's keywords) on tiny-llada: every step a full forward
    ("entropy", dict(alg="entropy")),
    ("maskgit_plus T=0.6 top_p=0.9", dict(alg="maskgit_plus", temperature=0.6, top_p=0.9)),
    ("confidence_threshold 0.8", dict(alg="confidence_threshold", threshold=0.8)),
    ("origin T=0.5", dict(alg="origin", temperature=0.5)),
]
AR_MIX = [("greedy", dict()), ("T=0.8 top_k=5", dict(temperature=0.8, top_k=5))]


SYSTEM_PROMPT = [(7 * i + 3) % 100 + 8 for i in range(48)]   # 48 shared tokens: 3 pages of 16


def requests(n: int, mix: list[tuple[str, dict[str, Any]]], max_tokens: int,
             system: list[int] | None = None) -> list[tuple[list[int], SamplingParams]]:
    problems = tasks.problems(n, tasks.EVAL_SEED)
    return [((system or []) + charset.encode_chat(p.prompt),
             SamplingParams(max_tokens=max_tokens, seed=i, **mix[i % len(mix)][1]))
            for i, p in enumerate(problems)]


def sequential(model, reqs, ar: bool) -> dict[str, Any]:
    eos = [charset.EOS_ID]
    rows, latencies, nfe = [], [], 0
    start = time.perf_counter()
    for ids, params in reqs:
        prompt = torch.tensor([ids])
        stats = remask.GenerationStats()
        generator = torch.Generator().manual_seed(params.seed)
        if ar:
            out = remask.ar_generate(model, prompt, generator=generator, stats=stats, **params.ar_kwargs(eos))
        elif params.alg is not None:
            out = remask.diffusion_generate(model, prompt, generator=generator, stats=stats,
                                            **params.diffusion_generate_kwargs())
        else:
            out = remask.generate(model, prompt, generator=generator, stats=stats, **params.generate_kwargs())
        row = out[0, prompt.shape[1]:].tolist()
        if ar and charset.EOS_ID in row:     # the engine stops at EOS; ar_generate pads after it
            row = row[:row.index(charset.EOS_ID) + 1]
        rows.append(row)
        nfe += stats.nfe
        latencies.append(time.perf_counter() - start)
    return dict(seconds=time.perf_counter() - start, rows=rows, latencies=latencies, forwards=nfe, nfe=nfe)


def engine_run(model, tokenizer, reqs, batch_invariant: bool, prefix_caching: bool = True) -> dict[str, Any]:
    kw = {} if remask.get_spec(model).kind != "ar" else dict(enable_prefix_caching=prefix_caching)
    engine = LLMEngine(model, tokenizer, max_num_seqs=256, batch_invariant=batch_invariant, **kw)
    start = time.perf_counter()
    for i, (ids, params) in enumerate(reqs):
        engine.add_request(str(i), ids, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
    seconds = time.perf_counter() - start
    outs = [done[i] for i in range(len(reqs))]
    return dict(seconds=seconds, rows=[o.outputs[0].all_token_ids for o in outs],
                latencies=[o.metrics["finish_time"] - start for o in outs], forwards=engine.runner.forwards,
                nfe=sum(o.outputs[0].nfe for o in outs), peak_pages=engine.kv_stats()["peak_pages_in_use"])


def step_overhead(rounds: int = 3) -> list[dict[str, Any]]:
    """Host time per step where compute is negligible: a random LLaDA of 84.6k parameters
    (2 layers, d_model 64), batch 1, prompt 32, gen 128, blocks of 32 — `remask.generate` and the
    engine (one request), without a cache and with the dual cache at threshold 0.9."""
    import tempfile

    from transformers import AutoModel

    from remask.models import tiny

    with tempfile.TemporaryDirectory() as folder:
        tiny.write_tiny_llada(folder, vocab_size=1000, embedding_size=1000, mask_token_id=999, eos_token_id=998,
                              pad_token_id=997)
        model = AutoModel.from_pretrained(folder).eval()
    prompt = torch.randint(0, 990, (1, 32), generator=torch.Generator().manual_seed(0))
    out = []
    for label, kw in (("no cache, 1 token/step", dict(steps=128, block_length=32)),
                      ("dual cache, threshold 0.9", dict(steps=128, block_length=32, threshold=0.9, use_cache="dual"))):
        params = SamplingParams(max_tokens=128, seed=0, **kw)
        for how in ("remask.generate", "engine"):
            best = float("inf")
            for _ in range(rounds):
                if how == "engine":
                    engine = LLMEngine(model, None)
                    start = time.perf_counter()
                    engine.add_request("x", prompt[0].tolist(), params)
                    while engine.has_unfinished_requests():
                        outs = engine.step()
                    seconds, steps = time.perf_counter() - start, outs[0].outputs[0].nfe
                else:
                    stats = remask.GenerationStats()
                    start = time.perf_counter()
                    remask.generate(model, prompt, generator=torch.Generator().manual_seed(0), stats=stats,
                                    **params.generate_kwargs())
                    seconds, steps = time.perf_counter() - start, stats.nfe
                best = min(best, seconds / steps)
            out.append(dict(setting=label, how=how, ms_per_step=best * 1e3, steps=steps,
                            parameters=sum(p.numel() for p in model.parameters())))
    return out


def registered_methods(block_length: int, listed: tuple[type, ...]) -> list[tuple[str, dict[str, Any]]]:
    """Every registered method (diffusion/methods/registry.py) not in `listed` that runs on a bidirectional mask
    model (way "method": not a model family's own loop, SDAR's or the canvas's), with its config's defaults and
    blocks of `block_length`: a method added by its file and registry line is measured here (and in
    bench/head_of_line.py) with no edit of this file."""
    from remask.diffusion.methods import registry

    return [(method.config.__name__, {method.field: method.config(), "block_length": block_length})
            for method in registry.METHODS.values() if method.config not in listed and method.way == "method"]


def method_settings(verifier) -> list[tuple[str, dict[str, Any]]]:
    """docs/compatibility.md's rows on tiny-llada (SamplingParams keywords), plus APD; AR is run on
    tiny-ar. Blocks of 16, 32 steps where the method reads steps (the compatibility table's setting)."""
    listed = (remask.FreeDave, remask.ThresholdDecoding, remask.CreditDecoding, remask.HierarchicalDecoding,
              remask.VicinityCache, remask.WINO, remask.DKVCache, remask.D2Cache, remask.ElasticCache, MarginDecoding,
              remask.EBSampler, remask.APDConfig)
    return [
        ("LLaDA low-confidence", dict(block_length=16)),
        ("threshold 0.9", dict(block_length=16, threshold=0.9)),
        ("threshold 0.9 + dual cache", dict(block_length=16, threshold=0.9, use_cache="dual")),
        ("Dream's sampler (entropy)", dict(alg="entropy")),
        ("FreeDave", dict(block_length=16, decoder=remask.FreeDave())),
        ("FreeDave + dual cache", dict(block_length=16, decoder=remask.FreeDave(), use_cache="dual")),
        ("dInfer threshold", dict(block_length=16, decoder=remask.ThresholdDecoding())),
        ("dInfer credit", dict(block_length=16, decoder=remask.CreditDecoding())),
        ("dInfer hierarchical", dict(block_length=16, decoder=remask.HierarchicalDecoding())),
        ("dInfer vicinity cache", dict(block_length=16, use_cache=remask.VicinityCache())),
        ("WINO", dict(block_length=16, decoder=remask.WINO())),
        ("dKV-Cache", dict(block_length=16, use_cache=remask.DKVCache())),
        ("d2Cache", dict(block_length=16, use_cache=remask.D2Cache())),
        ("Elastic-Cache", dict(use_cache=remask.ElasticCache())),
        ("Elastic-Cache + hierarchical", dict(use_cache=remask.ElasticCache(),
                                              decoder=remask.HierarchicalDecoding())),
        ("rule margin", dict(block_length=16, decoder=MarginDecoding())),
        ("EB-Sampler", dict(block_length=16, decoder=remask.EBSampler())),
        *registered_methods(16, listed),
        # options with their own forwards or blocks (d3LLM's delayed KV cache, SGLang's port), beside the defaults
        ("MultiBlock + its KV cache", dict(block_length=16, decoder=remask.MultiBlock(cache_delay_iter=1))),
        ("MultiBlock, SGLang's port", dict(block_length=16, decoder=remask.MultiBlock.sglang())),
        ("APD", dict(decoder=remask.APDConfig(verifier=verifier))),
    ]


def canvas_model() -> tuple[Any, Any]:
    """A random tiny DiffusionGemma in the official format on the zoo's character tokenizer (none is shipped: its
    answers are noise, its forwards and steps are the method's), or (None, None) where transformers lacks it."""
    import tempfile

    import transformers

    from remask.models import tiny

    if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
        return None, None
    path = tempfile.mkdtemp(prefix="remask-bench-dg-")
    tiny.write_tiny_diffusion_gemma(path, seed=1, charset=charset, generation={"max_denoising_steps": 8})
    return remask.load(path)


def drop_in(model, ids: list[int], params: SamplingParams, ar: bool) -> list[int]:
    """The drop-in call whose tokens the engine's request has (one request, alone)."""
    prompt = torch.tensor([ids])
    generator = torch.Generator().manual_seed(params.seed)
    if remask.models.get_spec(model).layout == "encoder-decoder":   # DiffusionGemma's canvases (pad after an EOS)
        settings = params.decoder.generation_kwargs() if params.decoder is not None else {}
        return remask.diffusion_generate(model, prompt, max_new_tokens=params.max_tokens, generator=generator,
                                         **settings).sequences[0, len(ids):len(ids) + params.max_tokens].tolist()
    if ar:
        out = remask.ar_generate(model, prompt, generator=generator, **params.ar_kwargs([charset.EOS_ID]))
        row = out[0, len(ids):].tolist()
        return row[:row.index(charset.EOS_ID) + 1] if charset.EOS_ID in row else row
    if params.alg is not None:
        out = remask.diffusion_generate(model, prompt, generator=generator, **params.diffusion_generate_kwargs())
    elif params.way == "apd":
        out = remask.generate(model, prompt, gen_length=params.max_tokens, decoder=params.decoder, generator=generator)
    else:
        kw = params.generate_kwargs()
        if params.decoder is not None:
            kw["decoder"] = params.decoder
        out = remask.generate(model, prompt, generator=generator, **kw)
    return out[0, len(ids):].tolist()


# The per-method rows' clock: wall time, or with --cpu-time this process's CPU time (`time.process_time`, one
# intra-op thread), which other load on a shared machine moves far less
CLOCK = {"now": time.perf_counter}


class ForwardClock:
    """Seconds spent inside the models' forwards (their own arithmetic), by hooks on the modules a request runs
    (`forward_modules`); a call nested in another clocked one (an encoder inside its model's forward) counts once."""

    def __init__(self, modules) -> None:
        self.seconds, self.calls, self._t, self._depth = 0.0, 0, 0.0, 0
        self.handles = [hook for m in modules for hook in (m.register_forward_pre_hook(self._pre),
                                                           m.register_forward_hook(self._post))]

    def _pre(self, *_):
        if self._depth == 0:
            self._t = CLOCK["now"]()
        self._depth += 1

    def _post(self, *_):
        self._depth -= 1
        if self._depth == 0:
            self.seconds += CLOCK["now"]() - self._t
            self.calls += 1

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def forward_modules(model, params: dict[str, Any]) -> list:
    """The modules whose forwards a method's requests run: the model, its encoder where its loop calls the
    encoder alone (DiffusionGemma's canvases: `ModelSpec.encoder`), APD's verifier."""
    encoder = remask.models.get_spec(model).encoder
    decoder = params.get("decoder")
    verifier = decoder.verifier if isinstance(decoder, remask.APDConfig) else None
    return [model, *[m for m in (encoder, verifier) if m is not None]]


class AttentionClock:
    """Seconds inside the packed forward's attention (`PackedAttention.attend`: every request's attention of a
    layer, per request, with its cache reads and writes), by wrapping it for the clock's life."""

    def __init__(self) -> None:
        from remask.diffusion.parts.varlen import PackedAttention

        self.seconds, self.cls, self.attend = 0.0, PackedAttention, PackedAttention.attend

        def timed(attention, *args, **kwargs):
            start = CLOCK["now"]()
            try:
                return self.attend(attention, *args, **kwargs)
            finally:
                self.seconds += CLOCK["now"]() - start
        self.cls.attend = timed

    def close(self) -> None:
        self.cls.attend = self.attend


def per_method(counts: list[int], max_tokens: int, repeats: int, only: str | None = None,
               varlen: bool = False) -> list[dict[str, Any]]:
    """Each method alone: n requests through the engine (default settings: batch invariance on; each reported at its
    end, as `LLM.generate` asks)
    against the n drop-in calls one by one, in the same run; model calls per engine step. `varlen`: the engine with
    `varlen_attention=True` (the DiffusionGemma row is left out: refused there)."""
    import warnings

    llada, llada_tok = remask.load("tiny-llada")
    ar, ar_tok = remask.load("tiny-ar")
    rows = []
    settings = [(label, kw, llada, llada_tok, False) for label, kw in method_settings(ar)]
    settings.append(("AR (tiny-ar)", dict(), ar, ar_tok, True))
    dg, dg_tok = canvas_model()
    if dg is not None:
        settings.append(("DiffusionGemma canvas (random tiny)", dict(), dg, dg_tok, False))
    if only:
        settings = [s for s in settings if any(word.lower() in s[0].lower() for word in only.split(","))]
    if varlen:   # (DiffusionGemma's canvases do not take it)
        settings = [s for s in settings if remask.get_spec(s[2]).layout != "encoder-decoder"]
    for model, tokenizer in ((llada, llada_tok), (ar, ar_tok), *([(dg, dg_tok)] if dg is not None else [])):   # once per process: the GEMM probe, allocations
        warm = LLMEngine(model, tokenizer)
        for i in range(2):
            warm.add_request(str(i), charset.encode_chat("sort 5281" + str(i)), SamplingParams(max_tokens=16))
        while warm.has_unfinished_requests():
            warm.step()
    for label, kw, model, tokenizer, is_ar in settings:
        for n in counts:
            problems = tasks.problems(n, tasks.EVAL_SEED)
            # each request reported once, at its end (`LLM.generate`'s setting: only finished outputs are read here)
            reqs = [(charset.encode_chat(p.prompt),
                     SamplingParams(max_tokens=max_tokens, seed=i, output_kind="final_only", **kw))
                    for i, p in enumerate(problems)]
            best: dict[str, Any] = {}
            for _ in range(repeats):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    # a method's own arithmetic: its models' forwards (APD: the dLLM's and the verifier's)
                    clock = ForwardClock(forward_modules(model, kw))
                    start = CLOCK["now"]()
                    seq_rows = [drop_in(model, ids, params, is_ar) for ids, params in reqs]
                    seq = CLOCK["now"]() - start
                    arithmetic = clock.seconds
                    clock.close()
                    runs = {}
                    for invariant in (True, False):
                        engine = LLMEngine(model, tokenizer, max_num_seqs=256, batch_invariant=invariant,
                                           **({"varlen_attention": True} if varlen else {}))
                        clock = ForwardClock(forward_modules(model, kw))
                        attention = AttentionClock()
                        start = CLOCK["now"]()
                        for i, (ids, params) in enumerate(reqs):
                            engine.add_request(str(i), ids, params)
                        done, steps = {}, 0
                        while engine.has_unfinished_requests():
                            steps += 1
                            for out in engine.step():
                                if out.finished:
                                    done[int(out.request_id)] = out
                        runs[invariant] = (CLOCK["now"]() - start, steps, engine.runner.forwards,
                                           [done[i].outputs[0].all_token_ids for i in range(n)],
                                           clock.seconds, attention.seconds)
                        for c in (clock, attention):
                            c.close()
                eng, steps, calls, rows_, inside, attended = runs[True]
                if not best or seq / eng > best["speedup"]:
                    best = dict(method=label, requests=n, sequential_s=seq, engine_s=eng, speedup=seq / eng,
                                arithmetic_s=arithmetic, arithmetic_share=arithmetic / seq,
                                engine_vs_arithmetic=eng / arithmetic, host_share=1 - inside / eng,
                                attention_share=attended / eng, steps=steps,
                                calls_per_step=calls / steps, identical=rows_ == seq_rows,
                                loose_s=runs[False][0], invariance_cost=eng / runs[False][0])
            rows.append(best)
            print(f"{label:30s} n={n:3d} seq {best['sequential_s']:6.2f}s engine {best['engine_s']:6.2f}s "
                  f"x{best['speedup']:.2f} arithmetic {best['arithmetic_share']:.0%} host {best['host_share']:.0%} "
                  f"attention {best['attention_share']:.0%} "
                  f"calls/step {best['calls_per_step']:.2f} invariance x{best['invariance_cost']:.2f} "
                  f"identical={best['identical']}", flush=True)
    return rows


def gemm_thresholds() -> str:
    """`batch_invariant.flat_threshold` for every linear weight of the shipped models: from which row
    count this CPU's GEMM gives every row the same bits (None: never, per-sequence GEMMs serve)."""
    from remask.kernels.batch_invariant import flat_threshold

    lines = ["| model | weight (out × in) | bias | flat threshold (rows) |", "| --- | --- | --- | ---: |"]
    for name in ("tiny-llada", "tiny-ar"):
        model, _ = remask.load(name)
        seen = set()
        for module in model.modules():
            if isinstance(module, torch.nn.Linear) and (tuple(module.weight.shape), module.bias is not None) not in seen:
                seen.add((tuple(module.weight.shape), module.bias is not None))
                threshold = flat_threshold(module.weight, module.bias)
                lines.append(f"| {name} | {module.weight.shape[0]} × {module.weight.shape[1]} | "
                             f"{'yes' if module.bias is not None else 'no'} | {threshold} |")
    return "\n".join(lines) + "\n"


def per_method_table(rows: list[dict[str, Any]], command: str) -> str:
    lines = [f"# Engine throughput per method: {platform.machine()} CPU, 1 thread, {datetime.date.today().isoformat()}",
             "", f"torch {torch.__version__}; command: `{command}`. Each method alone: n requests through "
             "`LLMEngine` (default settings, batch invariance on; `output_kind=\"final_only\"`, as `LLM.generate`) against the n drop-in calls one by one, "
             "in the same run (best ratio of the repeats). Arithmetic: the seconds the sequential calls spent "
             "inside the models' forwards (APD: the dLLM's and the verifier's; DiffusionGemma: its encoder's, called alone, "
             "too). Invariance cost: the engine's time with `batch_invariant=True` "
             "÷ with `batch_invariant=False`, same requests. Host share: the engine's time outside its models' forwards "
             "÷ its time (issue 47's bar: 10%); attention share: its time inside the packed forward's attention "
             "(`PackedAttention.attend`: each request's attention and cache work, a layer's requests one by one), "
             "part of the forward.", "",
             "| method | requests | sequential (s) | engine (s) | engine speed-up over sequential | arithmetic share "
             "of sequential | engine ÷ arithmetic | host share of engine | attention share of engine | engine steps "
             "| model calls per step | invariance cost | tokens identical |",
             "|" + " --- |" * 13]
    for r in rows:
        lines.append(f"| {r['method']} | {r['requests']} | {r['sequential_s']:.2f} | {r['engine_s']:.2f} | "
                     f"{r['speedup']:.2f}× | {r['arithmetic_share']:.0%} | {r['engine_vs_arithmetic']:.2f} | "
                     f"{r['host_share']:.0%} | {r['attention_share']:.0%} | "
                     f"{r['steps']} | {r['calls_per_step']:.2f} | {r['invariance_cost']:.2f}× | "
                     f"{'yes' if r['identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def summarize(name: str, n: int, result: dict[str, Any], reference_rows: list[list[int]]) -> dict[str, Any]:
    tokens = sum(len(r) for r in result["rows"])
    lat = sorted(result["latencies"])
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    return dict(run=name, requests=n, seconds=result["seconds"], tokens_per_s=tokens / result["seconds"],
                requests_per_s=n / result["seconds"], nfe_per_token=result["nfe"] / tokens,
                p50_latency_s=statistics.median(lat), p99_latency_s=p99, forwards=result["forwards"],
                identical=result["rows"] == reference_rows, peak_pages=result.get("peak_pages"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/engine.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", default="1,8,32,64,256", help="comma-separated request counts")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each measurement (the fastest is kept)")
    parser.add_argument("--out", default=None, help="markdown table to write (default: print only)")
    parser.add_argument("--per-method", action="store_true",
                        help="each method alone (docs/compatibility.md's rows, APD, AR, DiffusionGemma's canvas on a "
                             "random tiny checkpoint): engine ÷ sequential "
                             "and model calls per engine step (default --requests 8,32,64 --max-tokens 32)")
    parser.add_argument("--methods", default=None,
                        help="with --per-method: only the rows whose label contains one of these comma-separated words")
    parser.add_argument("--cpu-time", action="store_true",
                        help="with --per-method: CPU seconds of this process instead of wall seconds (A/B runs on a "
                             "machine with other load)")
    parser.add_argument("--varlen-attention", action="store_true",
                        help="with --per-method: LLMEngine(varlen_attention=True), one varlen attention call per "
                             "layer for the whole model call (not the DiffusionGemma row)")
    parser.add_argument("--gemm-thresholds", action="store_true",
                        help="the flat-GEMM row-invariance threshold measured for each weight of the shipped models")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gemm_thresholds:
        text = (f"# Flat GEMM thresholds: {platform.machine()} CPU, {args.threads} thread(s), "
                f"{datetime.date.today().isoformat()}, torch {torch.__version__}\n\n"
                f"`python bench/engine.py --gemm-thresholds --threads {args.threads}`\n\n" + gemm_thresholds())
        write_markdown(text, args.out)
        return 0
    for flag in ("cpu_time", "varlen_attention"):
        if getattr(args, flag) and not args.per_method:
            parser.error(f"--{flag.replace('_', '-')}: the per-method rows only (--per-method)")
    if args.per_method:
        CLOCK["now"] = time.process_time if args.cpu_time else time.perf_counter
        counts = [int(c) for c in (args.requests if args.requests != parser.get_default("requests")
                                   else "8,32,64").split(",")]
        max_tokens = args.max_tokens if args.max_tokens != parser.get_default("max_tokens") else 32
        rows = per_method(counts, max_tokens, args.repeats, args.methods, args.varlen_attention)
        command = (f"python bench/engine.py --per-method --requests {','.join(map(str, counts))} "
                   f"--max-tokens {max_tokens} --repeats {args.repeats}"
                   + (f" --methods {args.methods}" if args.methods else "") + (" --cpu-time" if args.cpu_time else "")
                   + (" --varlen-attention" if args.varlen_attention else ""))
        write_markdown(per_method_table(rows, command), args.out)
        # the varlen route sums attention in another order than the drop-in's SDPA: its tokens may differ
        return 0 if args.varlen_attention or all(r["identical"] for r in rows) else 1
    counts = [int(c) for c in args.requests.split(",")]
    llada, llada_tok = remask.load("tiny-llada")
    ar, ar_tok = remask.load("tiny-ar")
    rows = []
    for label, model, tokenizer, mix, is_ar, system in (
            ("tiny-llada, mixed (incl. caches)", llada, llada_tok, LLADA_MIX, False, None),
            ("tiny-llada, uncached rules", llada, llada_tok, UNCACHED_MIX, False, None),
            ("tiny-llada, Dream's sampler", llada, llada_tok, DREAM_MIX, False, None),
            ("tiny-ar", ar, ar_tok, AR_MIX, True, None),
            ("tiny-ar, 48-token shared system prompt", ar, ar_tok, AR_MIX, True, SYSTEM_PROMPT)):
        for n in counts:
            reqs = requests(n, mix, args.max_tokens, system)
            runs = {"sequential": lambda: sequential(model, reqs, is_ar),
                    "engine": lambda: engine_run(model, tokenizer, reqs, True),
                    "engine, batch_invariant=False": lambda: engine_run(model, tokenizer, reqs, False)}
            if system is not None:
                runs["engine, no prefix caching"] = lambda: engine_run(model, tokenizer, reqs, True, False)
            best: dict[str, dict[str, Any]] = {}
            for _ in range(args.repeats):      # interleaved, the fastest of each kept: the machine is shared
                for name, fn in runs.items():
                    result = fn()
                    if name not in best or result["seconds"] < best[name]["seconds"]:
                        best[name] = result
            base = best["sequential"]
            for name, result in best.items():
                row = summarize(name, n, result, base["rows"])
                row["workload"] = label
                row["speedup"] = base["seconds"] / result["seconds"]
                rows.append(row)
                print(f"{label:34s} n={n:4d} {name:30s} {row['tokens_per_s']:8.0f} tok/s  x{row['speedup']:.2f}  "
                      f"identical={row['identical']}", flush=True)
    header = ("| workload | requests | run | generated tok/s | × sequential | requests/s | NFE/token | p50 latency (s) "
              "| p99 latency (s) | model forwards | peak KV pages | tokens identical |")
    lines = [f"# Engine benchmark: {platform.machine()} CPU, {args.threads} thread(s), "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}, Python {sys.version.split()[0]}; max_tokens={args.max_tokens}; "
             f"command: `python bench/engine.py --requests {args.requests} --threads {args.threads} "
             f"--repeats {args.repeats}` (fastest of the repeats, run interleaved)", "",
             "Peak KV pages: the autoregressive page store's (pages of 16 positions); a diffusion request "
             "keeps its own cache, so there is none.", "",
             header, "|" + " --- |" * 12]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['requests']} | {r['run']} | {r['tokens_per_s']:.0f} | {r['speedup']:.2f} | "
                     f"{r['requests_per_s']:.1f} | {r['nfe_per_token']:.3f} | {r['p50_latency_s']:.3f} | "
                     f"{r['p99_latency_s']:.3f} | {r['forwards']} | "
                     f"{r['peak_pages'] if r['peak_pages'] else '-'} | {'yes' if r['identical'] else 'NO'} |")
    overhead = step_overhead(max(3, args.repeats))
    lines += ["", f"Per-step host time, compute negligible ({overhead[0]['parameters']} parameters, batch 1, gen 128, "
              "blocks of 32; best of 3; the issue's aim: <= 0.5 ms):", "",
              "| setting | run | steps | ms per step |", "| --- | --- | ---: | ---: |"]
    for r in overhead:
        lines.append(f"| {r['setting']} | {r['how']} | {r['steps']} | {r['ms_per_step']:.3f} |")
        print(f"{r['setting']:28s} {r['how']:16s} {r['ms_per_step']:.3f} ms/step", flush=True)
    text = "\n".join(lines) + "\n"
    write_markdown(text, args.out)
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
