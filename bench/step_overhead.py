"""Per-step host overhead and device→host synchronisations of one decoding step (issue 31).

    python bench/step_overhead.py --out bench/results/step-overhead-<machine>-<date>.md

On the shipped tiny-llada (compute negligible), for LLaDA's block rule without a cache, with the
dual cache, and Fast-dLLM's threshold rule with the dual cache: the time of one `BlockDecoder.step`
(forward + commit) against a bare model forward of the same shape in the same run; overhead =
step − forward. And the host synchronisations one step makes, counted by `remask.diffusion.stats.SyncCounter`
(`.item()`, `.tolist()`, `.cpu()`, `bool(tensor)`, `nonzero`, `int(tensor)` / `float(tensor)` on
a tensor): each is a device→host round trip on a GPU, and a step that has any cannot be captured
whole in a CUDA graph. Reported: median of `--repeats` steps (fresh states, every step of a
generation), one intra-op thread.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from collections import Counter
from typing import Any

import torch

import remask
from remask.diffusion.llada import BlockDecoder
from remask.diffusion.stats import SyncCounter
from remask.models.spec import get_spec
from remask.zoo import charset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)

CASES = {
    "low-confidence, no cache": dict(steps=32, gen_length=32, block_length=8),
    "low-confidence, dual cache": dict(steps=32, gen_length=32, block_length=8, use_cache="dual"),
    "threshold 0.9, dual cache": dict(steps=32, gen_length=32, block_length=8, use_cache="dual", threshold=0.9),
}


def measure(model, spec, prompt: torch.Tensor, settings: dict[str, Any], repeats: int) -> dict[str, Any]:
    decoder = BlockDecoder(spec, **settings)
    steps, forwards, syncs = [], [], Counter()
    per_step_syncs = []
    while len(steps) < repeats:
        state = decoder.start(model, prompt)
        while not state.done and len(steps) < repeats:
            # the bare forward this step runs, alone (same shapes, same cache state is not needed:
            # the forward's cost is its shape's on a tiny model)
            t = time.perf_counter()
            with torch.no_grad():
                spec.logits(model, state.x)
            full = time.perf_counter() - t
            counter = SyncCounter()
            t = time.perf_counter()
            with torch.no_grad(), counter:
                decoder.step(model, state)
            steps.append(time.perf_counter() - t)
            forwards.append(full)
            syncs.update(counter.counts)
            per_step_syncs.append(counter.total)
    return dict(step=statistics.median(steps), forward=statistics.median(forwards),
                syncs=statistics.median(per_step_syncs), kinds=dict(syncs), n=len(steps))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/step_overhead.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=200, help="steps measured per case")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="markdown table to write (default: print only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, _ = remask.load("tiny-llada")
    spec = get_spec(model)
    prompt = torch.tensor([charset.encode_chat("sort 52814")])
    measure(model, spec, prompt, CASES["low-confidence, no cache"], 20)   # warm-up
    lines = [f"# Step overhead: {platform.machine()} CPU, {args.threads} thread(s), "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}; tiny-llada, prompt {prompt.shape[1]} tokens, 32 new tokens in blocks of 8; "
             f"command: `python bench/step_overhead.py --repeats {args.repeats} --threads {args.threads}` (medians "
             f"over {args.repeats} steps). overhead = step − a bare full-sequence forward measured just before it "
             "(with a cache the step's own forward is smaller than that, so this overstates the forward and "
             "understates the overhead). Syncs: host waits per step (`remask.diffusion.stats.SyncCounter`).", "",
             "| case | step (ms) | bare forward (ms) | overhead (ms) | ratio step / forward | syncs per step | "
             "sync calls (all steps) |", "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, settings in CASES.items():
        r = measure(model, spec, prompt, settings, args.repeats)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items()))
        lines.append(f"| {name} | {1e3 * r['step']:.3f} | {1e3 * r['forward']:.3f} | "
                     f"{1e3 * (r['step'] - r['forward']):.3f} | {r['step'] / r['forward']:.2f} | {r['syncs']:.0f} | "
                     f"{kinds} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    write_markdown(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
