"""Head-of-line benchmark: short requests alone, and beside one long request of each method, in the
same run, on tiny-llada (docs/engine.md, "Every method steps").

    python bench/head_of_line.py --out bench/results/head-of-line-<machine>-<date>.md

Short requests: `--short` of them (16 tokens, dInfer-style threshold 0.9 over blocks of 8 with the
dual cache: `threshold=0.9, use_cache="dual"`), all queued at once. "alone": only they run. "beside
<method>": one long request (`--long-tokens` tokens, blocks of 32) of that method is queued first,
then the same short requests. Reported: the time until the last short request finishes (the
makespan, seconds) and the engine steps, the ratio beside / alone, and whether the short requests'
tokens are the same in both runs (they must be: a request's tokens never depend on its
batch-mates). Each scenario runs `--repeats` times interleaved and the fastest run is kept (the
machine is shared). One intra-op thread by default (the tests' setting).

Every method runs step by step in the engine (`diffusion/parts/stepper.py`): the long request takes one
forward per engine step, so the short ones wait for at most one of its forwards per step instead
of its whole generation.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from typing import Any

import torch

import remask
from remask.engine import LLMEngine, SamplingParams
from remask.zoo import charset, tasks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from engine import registered_methods  # noqa: E402  (bench/engine.py)
from report import write_markdown  # noqa: E402  (bench/report.py)

SHORT = dict(max_tokens=16, block_length=8, threshold=0.9, use_cache="dual")
# --structured: the long request holds to a JSON schema, every other short one to a regex
LONG_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                                         "maxItems": 12}},
               "required": ["items"], "additionalProperties": False}
SHORT_REGEX = r"[0-9]{1,6}"


def long_methods(tokens: int) -> dict[str, dict[str, Any]]:
    """One long request per method: the SamplingParams keywords (besides max_tokens)."""
    blocks = dict(block_length=32)
    return {
        "LLaDA low-confidence": dict(steps=tokens, **blocks),
        "Fast-dLLM threshold + dual cache": dict(threshold=0.9, use_cache="dual", **blocks),
        "FreeDave": dict(decoder=remask.FreeDave(), **blocks),
        "FreeDave + dual cache": dict(decoder=remask.FreeDave(), use_cache="dual", **blocks),
        "dInfer threshold": dict(decoder=remask.ThresholdDecoding(), **blocks),
        "dInfer credit": dict(decoder=remask.CreditDecoding(), **blocks),
        "dInfer hierarchical": dict(decoder=remask.HierarchicalDecoding(), **blocks),
        "dInfer vicinity cache": dict(use_cache=remask.VicinityCache(), **blocks),
        "WINO": dict(decoder=remask.WINO(), **blocks),
        "dKV-Cache": dict(use_cache=remask.DKVCache(), steps=tokens, **blocks),
        "d2Cache": dict(use_cache=remask.D2Cache(), steps=tokens, **blocks),
        "Elastic-Cache": dict(use_cache=remask.ElasticCache()),
        # every other registered method, with its defaults (bench/engine.py)
        **dict(registered_methods(32, (remask.FreeDave, remask.ThresholdDecoding, remask.CreditDecoding,
                                       remask.HierarchicalDecoding, remask.VicinityCache, remask.WINO,
                                       remask.DKVCache, remask.D2Cache, remask.ElasticCache, remask.APDConfig))),
        "MultiBlock + its KV cache": dict(decoder=remask.MultiBlock(cache_delay_iter=1), **blocks),
        "MultiBlock, SGLang's port": dict(decoder=remask.MultiBlock.sglang(), **blocks),
    }


def scenario(model, tokenizer, prompts: list[list[int]], long: dict[str, Any] | None, tokens: int,
             cost_stride: bool = True, structured: bool = False) -> dict[str, Any]:
    engine = LLMEngine(model, tokenizer, max_num_seqs=64, cost_stride=cost_stride)
    start = time.perf_counter()
    if long is not None:
        extra = dict(structured_outputs=remask.StructuredOutputsParams(json=LONG_SCHEMA)) if structured else {}
        engine.add_request("long", prompts[0], SamplingParams(max_tokens=tokens, seed=0, **long, **extra))
    short = [f"s{i}" for i in range(len(prompts) - 1)]
    for rid, ids in zip(short, prompts[1:]):
        extra = dict(structured_outputs=remask.StructuredOutputsParams(regex=SHORT_REGEX)) \
            if structured and int(rid[1:]) % 2 else {}
        engine.add_request(rid, ids, SamplingParams(seed=int(rid[1:]) + 1, **SHORT, **extra))
    steps, done, finished = 0, {}, {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        steps += 1
        for out in outs:
            if out.finished:
                finished[out.request_id] = out
                done[out.request_id] = (time.perf_counter() - start, steps)
    if any(out.outputs[0].error for out in finished.values()):
        raise RuntimeError({rid: out.outputs[0].error for rid, out in finished.items() if out.outputs[0].error})
    return dict(seconds=max(done[r][0] for r in short), steps=max(done[r][1] for r in short),
                tokens={r: finished[r].outputs[0].all_token_ids for r in short},
                long_seconds=done["long"][0] if long is not None else None,
                long_steps=done["long"][1] if long is not None else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/head_of_line.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--short", type=int, default=8, help="short requests per scenario")
    parser.add_argument("--long-tokens", type=int, default=96, help="tokens of the long request")
    parser.add_argument("--methods", default=None, help="semicolon-separated subset of the methods (default: all)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-cost-stride", action="store_true",
                        help="LLMEngine(cost_stride=False): every picked sequence steps every engine step")
    parser.add_argument("--structured", action="store_true",
                        help="structured requests in the mix: the long request holds to a JSON schema, every other "
                             "short one to a regex (methods that refuse a structure are left out)")
    parser.add_argument("--out", default=None, help="markdown table to write (default: print only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = remask.load("tiny-llada")
    prompts = [charset.encode_chat(p.prompt) for p in tasks.problems(args.short + 1, tasks.EVAL_SEED)]
    methods = long_methods(args.long_tokens)
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(";")]
        unknown = [m for m in wanted if m not in methods]
        if unknown:
            parser.error(f"--methods: unknown {unknown}; choose from {sorted(methods)}")
        methods = {m: methods[m] for m in wanted}
    if args.structured:   # a method that refuses a structure is left out (named in the table)
        refused = {}
        for name, long in list(methods.items()):
            try:
                SamplingParams(max_tokens=args.long_tokens, structured_outputs=remask.StructuredOutputsParams(
                    json=LONG_SCHEMA), **long)
                LLMEngine(model, tokenizer).add_request("probe", prompts[0], SamplingParams(
                    max_tokens=args.long_tokens, structured_outputs=remask.StructuredOutputsParams(json=LONG_SCHEMA),
                    **long))
            except ValueError as err:
                refused[name] = str(err).splitlines()[0]
                methods.pop(name)
    scenario(model, tokenizer, prompts[:2], None, args.long_tokens)   # warm-up (first-call costs)
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):   # interleaved, the fastest of each kept: the machine is shared
        for name, long in [("alone", None), *methods.items()]:
            result = scenario(model, tokenizer, prompts, long, args.long_tokens, not args.no_cost_stride,
                              args.structured)
            if name not in best or result["seconds"] < best[name]["seconds"]:
                best[name] = result
    alone = best.pop("alone")
    lines = [f"# Head-of-line benchmark: {platform.machine()} CPU, {args.threads} thread(s), "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}, Python {sys.version.split()[0]}; tiny-llada; {args.short} short requests "
             f"({SHORT}) alone, and beside one {args.long_tokens}-token request of each method queued first. Command: "
             f"`python bench/head_of_line.py --short {args.short} --long-tokens {args.long_tokens} --threads "
             f"{args.threads} --repeats {args.repeats}{' --no-cost-stride' if args.no_cost_stride else ''}"
             f"{' --structured' if args.structured else ''}` (fastest of "
             f"the repeats; engine cost_stride={not args.no_cost_stride}).", "",
             *([f"Structured requests in the mix: the long request holds to the JSON schema `{LONG_SCHEMA}`, every "
                f"other short request to the regex `{SHORT_REGEX}` (alone and beside alike)."
                + (f" Left out (they refuse a structure): {refused}." if refused else ""), ""]
               if args.structured else []),
             f"Alone: the last short request finishes after {alone['seconds']:.3f} s, {alone['steps']} engine steps.",
             "", "| long request's method | short makespan (s) | ratio to alone | short steps | long request (s) "
             "| long request steps | short tokens unchanged |", "| --- |" + " ---: |" * 5 + " --- |"]
    worst, same_everywhere = 0.0, True
    for name, r in best.items():
        ratio = r["seconds"] / alone["seconds"]
        same = r["tokens"] == alone["tokens"]
        worst, same_everywhere = max(worst, ratio), same_everywhere and same
        lines.append(f"| {name} | {r['seconds']:.3f} | {ratio:.2f}× | {r['steps']} | {r['long_seconds']:.3f} "
                     f"| {r['long_steps']} | {'yes' if same else 'NO'} |")
    lines += ["", f"Worst ratio: {worst:.2f}× (bar: 1.3×). Short requests' tokens identical beside every method: "
              f"{'yes' if same_everywhere else 'NO'}."]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    write_markdown(text, args.out)
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    sys.exit(main())
