"""FreeDave's forwards per generated token against one-token-per-step decoding (the tokens checked
equal in the same run), on the shipped tiny-llada, for each cache mode and draft count.

    python bench/freedave.py --out bench/results/freedave-<machine>-<date>.md
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
    parser = argparse.ArgumentParser(prog="python bench/freedave.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gen-length", type=int, default=32)
    parser.add_argument("--block-length", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")   # tiny-llada was trained on shorter answers
    torch.set_num_threads(1)
    model, _ = remask.load("tiny-llada")
    texts = ("sort 52814", "rev abcdef", "sort 91735", "add 31+447")
    prompts = [torch.tensor([charset.encode_chat(t)]) for t in texts]
    G, BL = args.gen_length, args.block_length
    lines = [f"# FreeDave: forwards per token, {platform.machine()} CPU, {datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}; tiny-llada, {len(prompts)} chat prompts, gen_length {G}, block {BL}; "
             "every FreeDave output checked equal to one-token-per-step decoding in the same run.", "",
             "| use_cache | one token per step | K = 2 | K = 4 | K = 8 |", "| --- | ---: | ---: | ---: | ---: |"]
    for cache in (None, "prefix", "dual"):
        base = remask.GenerationStats()
        outs = [remask.generate(model, p, steps=G, gen_length=G, block_length=BL, use_cache=cache, stats=base)
                for p in prompts]
        row = [f"{base.nfe / (G * len(prompts)):.3f}"]
        for draft_steps in (2, 4, 8):
            stats = remask.GenerationStats()
            for p, expected in zip(prompts, outs):
                got = remask.generate(model, p, steps=G, gen_length=G, block_length=BL, use_cache=cache,
                                      decoder=remask.FreeDave(draft_steps=draft_steps), stats=stats)
                if not torch.equal(got, expected):
                    raise AssertionError(f"FreeDave differs from one token per step (use_cache={cache})")
            row.append(f"{stats.nfe / (G * len(prompts)):.3f}")
        lines.append(f"| {cache} | " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    write_markdown("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
