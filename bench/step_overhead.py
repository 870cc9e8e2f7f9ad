"""Per-step host overhead and host waits of one decoding step (issue 31).

    python bench/step_overhead.py --out bench/results/step-overhead-<machine>-<date>.md

On the shipped tiny-llada (compute negligible), for LLaDA's block rule without a cache, with the
dual cache, and Fast-dLLM's threshold rule with the dual cache: the time of one `BlockDecoder.step`,
the time spent inside the model's forward during it (hooks on the model), hence the step's own host
overhead (step − its forward: scoring, committing, cache and schedule bookkeeping; the issue's bar
is ≤ 0.5 ms), and a bare model forward of the step's input shape measured just before it in the
same run (the ratio step / bare forward). And the host waits one step makes, counted on a separate
pass by `remask.diffusion.parts.stats.SyncCounter` (`.item()`, `.tolist()`, `.cpu()`, `bool(tensor)`,
`nonzero`, `int(tensor)` / `float(tensor)`): each is a device→host round trip on a GPU, and a
step that has one cannot be captured whole in a CUDA graph (bar: ≤ 1). Reported: medians over
`--repeats` steps (fresh states, every step of a generation), one intra-op thread.
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
from remask.diffusion.families.llada import BlockDecoder
from remask.diffusion.parts.stats import SyncCounter
from remask.diffusion.parts.stepper import step_alone
from remask.models.spec import get_spec
from remask.zoo import charset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)

CASES = {
    "low-confidence, no cache": dict(steps=32, gen_length=32, block_length=8),
    "low-confidence, dual cache": dict(steps=32, gen_length=32, block_length=8, use_cache="dual"),
    "threshold 0.9, dual cache": dict(steps=32, gen_length=32, block_length=8, use_cache="dual", threshold=0.9),
}


class ForwardTimer:
    """Wall time spent inside `model`'s forward calls (hooks on the top module)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.total, self._t = 0.0, 0.0
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def _post(self, *args: Any) -> None:
        self.total += time.perf_counter() - self._t

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def measure(model, spec, prompt: torch.Tensor, settings: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Median over `repeats` steps of: the step, the model forward inside it, the step's host
    overhead (step − its own forward: scoring, committing, cache and schedule bookkeeping) and a
    bare forward of the step's input shape, measured just before it; and the step's host waits."""
    decoder = BlockDecoder(spec, **settings)
    steps, inside, bare, syncs = [], [], [], Counter()
    per_step_syncs = []
    timer = ForwardTimer(model)
    try:
        while len(steps) < repeats:
            state = decoder.start(prompt)
            while not state.done and len(steps) < repeats:
                start, end = decoder.block_span(state)
                fed = state.x if decoder.mode is None or state.step == 0 else state.x[:, start:end]
                t = time.perf_counter()
                with torch.no_grad():
                    spec.logits(model, fed)      # the same shape, no cache: the forward's own cost
                bare.append(time.perf_counter() - t)
                timer.total = 0.0
                t = time.perf_counter()
                with torch.no_grad():
                    step_alone(decoder, model, state)
                steps.append(time.perf_counter() - t)
                inside.append(timer.total)
    finally:
        timer.close()
    # The host waits, counted on a separate pass (the counter slows every torch call it sees).
    state = decoder.start(prompt)
    while not state.done:
        with torch.no_grad(), SyncCounter() as counter:
            step_alone(decoder, model, state)
        syncs.update(counter.counts)
        per_step_syncs.append(counter.total)
    overhead = [s - f for s, f in zip(steps, inside)]
    return dict(step=statistics.median(steps), inside=statistics.median(inside), bare=statistics.median(bare),
                overhead=statistics.median(overhead), syncs=max(per_step_syncs), kinds=dict(syncs), n=len(steps))


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
             f"over {args.repeats} steps). overhead = step − the model forward inside it (timed by hooks on the "
             "model): the step's own host work (scoring, committing, cache and schedule bookkeeping). bare "
             "forward = a model forward of the step's input shape alone (the whole sequence at a block start or "
             "without a cache, the block with the dual cache), measured just before the step. Host waits: the "
             "most in one step of a generation, and their kinds over its steps (`remask.diffusion.parts.stats.SyncCounter`, "
             "counted on a separate pass).", "",
             "| case | step (ms) | forward inside (ms) | overhead (ms) | bare forward (ms) | step / bare forward | "
             "host waits per step (most) | host waits (one generation) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for name, settings in CASES.items():
        r = measure(model, spec, prompt, settings, args.repeats)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(r["kinds"].items())) or "none"
        lines.append(f"| {name} | {1e3 * r['step']:.3f} | {1e3 * r['inside']:.3f} | {1e3 * r['overhead']:.3f} | "
                     f"{1e3 * r['bare']:.3f} | {r['step'] / r['bare']:.2f} | {r['syncs']} | {kinds} |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    write_markdown(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
