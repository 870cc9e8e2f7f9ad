"""Fairness benchmark: latency of small requests alone and beside one `n=128` request, in the same
run, on tiny-llada (docs/engine.md, Fairness).

    python bench/fairness.py --out bench/results/fairness-<machine>-<date>.md

Small requests (16 tokens, LLaDA's low-confidence rule, 16 steps, blocks of 8) arrive one every
`--gap` engine steps. "alone": only they run. "beside n=128": one request with `n=128` samples
(same settings) is added first, then the same small requests on the same step schedule. For each
small request it reports the latency (arrival → finish, seconds) and the engine steps it took
(arrival → finish), p50 / p99, and the ratios beside / alone. Steps are exact and show the
scheduler's bound; seconds also carry the cost of a step whose batch holds 64 sequences instead of
a few (compute-bound on a CPU). Each scenario runs `--repeats` times interleaved; the fastest run
(by the small requests' p99) is kept. One intra-op thread by default (the tests' setting).
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
from remask.engine import LLMEngine, SamplingParams
from remask.zoo import charset, tasks

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)

SMALL = dict(max_tokens=16, steps=16, block_length=8)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def scenario(model, tokenizer, prompts: list[list[int]], big: int, gap: int, max_num_seqs: int) -> dict[str, Any]:
    """Run one scenario; returns the small requests' latencies (s) and steps, and the big one's."""
    engine = LLMEngine(model, tokenizer, max_num_seqs=max_num_seqs)
    step, arrived, finished = 0, {}, {}
    start = time.perf_counter()
    if big:
        engine.add_request("big", prompts[0], SamplingParams(n=big, seed=0, **SMALL))
        arrived["big"] = 0
    pending = [(i * gap, f"s{i}", ids) for i, ids in enumerate(prompts[1:])]
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][0] <= step:
            _, rid, ids = pending.pop(0)
            engine.add_request(rid, ids, SamplingParams(seed=int(rid[1:]) + 1, **SMALL))
            arrived[rid] = step
        if not engine.has_unfinished_requests():   # idle until the next arrival: the clock is steps
            step += 1
            continue
        outs = engine.step()
        step += 1
        for out in outs:
            if out.finished:
                finished[out.request_id] = (out, step)
    small = [rid for rid in finished if rid != "big"]
    result = dict(latency=[finished[r][0].metrics["latency"] for r in small],
                  steps=[finished[r][1] - arrived[r] for r in small], seconds=time.perf_counter() - start,
                  texts={r: finished[r][0].outputs[0].all_token_ids for r in small})
    if big:
        result["big_latency"] = finished["big"][0].metrics["latency"]
        result["big_steps"] = finished["big"][1]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/fairness.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", type=int, default=32, help="small requests per scenario")
    parser.add_argument("--gap", type=int, default=2, help="engine steps between two small requests' arrivals")
    parser.add_argument("--n", type=int, default=128, help="samples of the big request")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=None, help="markdown table to write (default: print only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = remask.load("tiny-llada")
    prompts = [charset.encode_chat(p.prompt) for p in tasks.problems(args.small + 1, tasks.EVAL_SEED)]
    best: dict[str, dict[str, Any]] = {}
    for _ in range(args.repeats):            # interleaved, the fastest kept: the machine is shared
        for name, big in (("alone", 0), (f"beside n={args.n}", args.n)):
            result = scenario(model, tokenizer, prompts, big, args.gap, args.max_num_seqs)
            if name not in best or percentile(result["latency"], 0.99) < percentile(best[name]["latency"], 0.99):
                best[name] = result
    alone, beside = best["alone"], best[f"beside n={args.n}"]
    identical = alone["texts"] == beside["texts"]     # the small requests' tokens do not depend on the big one
    rows = []
    for name, r in best.items():
        rows.append(dict(run=name, p50=statistics.median(r["latency"]), p99=percentile(r["latency"], 0.99),
                         s50=statistics.median(r["steps"]), s99=percentile(r["steps"], 0.99), smax=max(r["steps"]),
                         big=r.get("big_latency"), big_steps=r.get("big_steps")))
    ratio = {k: rows[1][k] / rows[0][k] for k in ("p50", "p99", "s50", "s99")}
    lines = [f"# Fairness benchmark: {platform.machine()} CPU, {args.threads} thread(s), "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}, Python {sys.version.split()[0]}; tiny-llada; {args.small} small requests "
             f"({SMALL}), one every {args.gap} steps; max_num_seqs={args.max_num_seqs}; command: `python "
             f"bench/fairness.py --small {args.small} --gap {args.gap} --n {args.n} --max-num-seqs "
             f"{args.max_num_seqs} --threads {args.threads} --repeats {args.repeats}` (fastest of the repeats by p99)",
             "", "| run | small p50 (s) | small p99 (s) | small steps p50 | small steps p99 | small steps max "
             "| big request latency (s) | big request steps |", "| --- |" + " ---: |" * 7]
    for r in rows:
        big = "-" if r["big"] is None else f"{r['big']:.3f}"
        big_steps = "-" if r["big_steps"] is None else str(r["big_steps"])
        lines.append(f"| {r['run']} | {r['p50']:.3f} | {r['p99']:.3f} | {r['s50']:.0f} | {r['s99']:.0f} | {r['smax']} "
                     f"| {big} | {big_steps} |")
    lines += ["", f"Ratio beside / alone: p50 {ratio['p50']:.2f}×, p99 {ratio['p99']:.2f}× (seconds); "
              f"steps p50 {ratio['s50']:.2f}×, p99 {ratio['s99']:.2f}×. Small requests' tokens identical in both "
              f"runs: {'yes' if identical else 'NO'}."]
    text = "\n".join(lines) + "\n"
    print(text if args.out else "", end="")
    write_markdown(text, args.out)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
