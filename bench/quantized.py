"""Accuracy and speed of the shipped tiny models with int8 weights (torchao weight-only through
transformers) against float32, on the zoo's held-out problems, in the same run.

    python bench/quantized.py --out bench/results/quantized-<machine>-<date>.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys

import torch

import remask
from remask.zoo.evaluate import Strategy, evaluate
from remask.zoo.tasks import EVAL_SEED, problems

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)

RUNS = [("tiny-llada", Strategy.of("1 token/step", steps=16)),
        ("tiny-llada", Strategy.of("blocks of 8, threshold 0.9", steps=16, block_length=8, threshold=0.9)),
        ("tiny-llada", Strategy.of("dual cache + threshold 0.9", steps=16, block_length=8, threshold=0.9,
                                   use_cache="dual")),
        ("tiny-ar", Strategy.of("greedy", ar=True))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/quantized.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=140)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    held_out = problems(args.problems, EVAL_SEED)
    models = {(name, q): remask.load(name, quantization=q)[0] for name in ("tiny-llada", "tiny-ar")
              for q in (None, "int8")}
    lines = [f"# int8 weights vs float32: {platform.machine()} CPU, {args.threads} thread(s), "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}; {args.problems} held-out problems, batch 1; command: "
             f"`python bench/quantized.py --problems {args.problems}`", "",
             "| model | decoding | float32 accuracy | int8 accuracy | answers equal | float32 tok/s | int8 tok/s |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, strategy in RUNS:
        fp32 = evaluate(models[name, None], held_out, strategy)
        int8 = evaluate(models[name, "int8"], held_out, strategy)
        same = sum(a == b for a, b in zip(fp32.outputs, int8.outputs))
        lines.append(f"| {name} | {strategy.name} | {fp32.accuracy:.1%} | {int8.accuracy:.1%} | "
                     f"{same}/{len(held_out)} | {fp32.tokens_per_second:.0f} | {int8.tokens_per_second:.0f} |")
        print(lines[-1], flush=True)
    write_markdown("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
