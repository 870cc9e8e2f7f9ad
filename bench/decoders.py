"""Decoders II on the shipped tiny-llada: forwards and positions computed per generated token for
every decoder and cache config, against one-token-per-step decoding in the same run (lossless
FreeDave checked identical to it).

    python bench/decoders.py --out bench/results/decoders-<machine>-<date>.md

Counts, not times: `GenerationStats.nfe` and `.forward_positions` (positions the model computed,
summed over forwards and rows), divided by the generated tokens.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import warnings

import torch

import remask
from remask.zoo import charset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/decoders.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--block-length", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")   # tiny-llada was trained on shorter answers
    torch.set_num_threads(1)
    model, _ = remask.load("tiny-llada")
    texts = ("sort 52814", "rev abcdef", "sort 91735", "add 31+447")
    prompts = [torch.tensor([charset.encode_chat(t)]) for t in texts]
    G, BL = args.gen_length, args.block_length
    settings = [
        ("one token per step (baseline)", dict(steps=G)),
        ("one token per step, dual cache", dict(steps=G, use_cache="dual")),
        ("Fast-dLLM threshold 0.9", dict(steps=G, threshold=0.9)),
        ("FreeDave K=4 (lossless)", dict(steps=G, decoder=remask.FreeDave(draft_steps=4))),
        ("FreeDave K=4, dual cache (lossless)", dict(steps=G, use_cache="dual", decoder=remask.FreeDave())),
        ("dInfer threshold 0.9", dict(decoder=remask.ThresholdDecoding())),
        ("dInfer credit 0.9", dict(decoder=remask.CreditDecoding())),
        ("dInfer hierarchy 0.9 / 0.4", dict(decoder=remask.HierarchicalDecoding())),
        ("dInfer threshold + vicinity cache", dict(use_cache=remask.VicinityCache(prefix_look=8, after_look=8))),
        ("dInfer threshold 0.9 + iteration smoothing",
         dict(decoder=remask.ThresholdDecoding(smoothing=remask.IterationSmoothing()))),
        ("WINO 0.6 / 0.9", dict(decoder=remask.WINO())),
        ("dKV-Cache R=8", dict(steps=G, use_cache=remask.DKVCache(cache_reloading_step=8))),
        ("dKV-Cache-Greedy R=2, window 4 (random order)",
         dict(steps=G, remasking="random", generator=torch.Generator().manual_seed(0),
              use_cache=remask.DKVCache(cache_reloading_step=2, variant="greedy", window_size=4))),
        ("d2Cache (current_k 8)", dict(steps=G, use_cache=remask.D2Cache(current_k=8))),
        ("Elastic-Cache (window 16)", dict(use_cache=remask.ElasticCache(), block_length=G)),
    ]
    lines = [f"# Decoders II: forwards and positions per token, {platform.machine()} CPU, "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}; tiny-llada, {len(prompts)} chat prompts, gen_length {G}, block {BL} "
             "(Elastic-Cache: no blocks); counts, not times.", "",
             "| method | forwards per token | positions computed per token | vs baseline |",
             "| --- | ---: | ---: | ---: |"]
    baseline = {}
    base_positions = None
    for name, kw in settings:
        kw = dict(kw)
        block = kw.pop("block_length", BL)
        stats = remask.GenerationStats()
        outs = [remask.generate(model, p, gen_length=G, block_length=block, stats=stats, **kw) for p in prompts]
        if "lossless" in name:
            reference = baseline["dual" if kw.get("use_cache") == "dual" else None]
            if any(not torch.equal(a, b) for a, b in zip(outs, reference)):
                raise AssertionError(f"{name} differs from one token per step")
        if name.startswith("one token per step"):
            baseline["dual" if kw.get("use_cache") == "dual" else None] = outs
        tokens = G * len(prompts)
        positions = stats.forward_positions / tokens
        base_positions = base_positions or positions
        lines.append(f"| {name} | {stats.nfe / tokens:.3f} | {positions:.1f} | {positions / base_positions:.2f}× |")
        print(lines[-1], flush=True)
    write_markdown("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
