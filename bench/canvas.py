"""DiffusionGemma's canvas step: remask's scoring + update against transformers' formulation, and
forwards per canvas of each accept rule on a tiny random DiffusionGemma, in the same run.

    python bench/canvas.py --out bench/results/canvas-<machine>-<date>.md

1. One step's sampler work on `[rows, V]` logits (no model): transformers' path (float32 softmax,
   `torch.multinomial`, `argmax`, `Categorical(...).entropy()`, sort + cumsum + scatter, `randint`,
   `where`) against `remask.kernels.canvas.canvas_score` + `canvas_update` (the Triton kernels on
   CUDA; here, without a GPU, their float64 torch reference, which is the CPU runtime).
2. Forwards per canvas and tokens per forward of each rule (`remask.CanvasSampler`) on a tiny
   random checkpoint (tokens of a random model mean nothing: only the step counts are reported).
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import torch

import remask
from remask.kernels.canvas import canvas_score, canvas_update

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)


def transformers_step(logits: torch.Tensor, temperature: torch.Tensor, bound: float):
    processed = logits / temperature
    probs = torch.softmax(processed, dim=-1, dtype=torch.float32)
    sample = torch.multinomial(probs, 1).squeeze(-1)
    argmax = torch.argmax(processed, dim=-1)
    entropy = torch.distributions.Categorical(logits=processed).entropy()[None]
    sorted_entropy, order = torch.sort(entropy, dim=-1)
    keep = torch.cumsum(sorted_entropy, dim=-1) - sorted_entropy <= bound
    accepted = torch.scatter(torch.zeros_like(keep), -1, order, keep)
    noise = torch.randint(0, logits.shape[-1], entropy.shape)
    return torch.where(accepted, sample[None], noise), argmax


def remask_step(logits: torch.Tensor, temperature: torch.Tensor, bound: float):
    sample, argmax, entropy, _ = canvas_score(logits, temperature, seed=1)
    return canvas_update(sample[None], entropy[None], bound, vocab_size=logits.shape[-1], seed=2)[0], argmax


def best_of(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def rules_table(steps: int) -> list[str]:
    from remask.models import tiny
    from transformers import AutoModelForImageTextToText

    folder = tempfile.mkdtemp()
    tiny.write_tiny_diffusion_gemma(folder, seed=0)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    prompt = torch.tensor([[2, 17, 42, 99, 5], [2, 9, 8, 7, 6]])
    rules = [("reference EB, bound 0.1 (transformers' draws)", None, True),
             ("EB, bound 0.1 (fused kernels)", remask.CanvasSampler(), False),
             ("threshold 0.9", remask.CanvasSampler(rule="threshold", threshold=0.9), False),
             ("threshold 0.5", remask.CanvasSampler(rule="threshold", threshold=0.5), False),
             ("top-k 2", remask.CanvasSampler(rule="top_k", top_k=2), False),
             ("EB + freeze after 2", remask.CanvasSampler(freeze_after=2), False),
             ("EB + freeze after 1", remask.CanvasSampler(freeze_after=1), False)]
    lines = [f"Tiny random DiffusionGemma (`tiny.write_tiny_diffusion_gemma`, canvas 8, V 301), 2 prompts × "
             f"4 canvases, max_denoising_steps {steps}, default stopping (stability 1, confidence 0.005).", "",
             "| rule | forwards per canvas | accepted per step | tokens per forward |",
             "| --- | ---: | ---: | ---: |"]
    for name, sampler, reference in rules:
        stats = remask.GenerationStats()
        torch.manual_seed(0)
        out = remask.diffusion_generate(model, prompt, max_new_tokens=32, max_denoising_steps=steps,
                                        canvas_sampler=sampler, reference_rng=reference, stats=stats)
        lines.append(f"| {name} | {stats.nfe / 4:.1f} | {stats.mean_tokens_per_step / 2:.2f} | "
                     f"{float(out.tokens_per_forward.mean()):.2f} |")
        print(lines[-1], flush=True)
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/canvas.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    lines = [f"# DiffusionGemma canvas step: {platform.machine()} CPU, {args.threads} thread(s), "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}; command: `python bench/canvas.py --threads {args.threads}`. "
             "No GPU was available: the remask column is the kernels' torch reference (float64, the CPU "
             "runtime), not the Triton kernels.", "",
             "## One step's sampler work (no model)", "",
             "| rows × V | transformers | remask (torch path) | ratio |", "| --- | ---: | ---: | ---: |"]
    temperature = torch.tensor(0.6)
    for rows, V in ((256, 4096), (256, 32768), (64, 262144)):
        logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(0)) * 4
        t_ref = best_of(lambda: transformers_step(logits, temperature, 0.1), args.repeats)
        t_ours = best_of(lambda: remask_step(logits, temperature, 0.1), args.repeats)
        lines.append(f"| {rows} × {V} | {t_ref * 1e3:.1f} ms | {t_ours * 1e3:.1f} ms | {t_ref / t_ours:.2f}× |")
        print(lines[-1], flush=True)
    lines += ["", "## Forwards per canvas by accept rule", ""] + rules_table(args.steps)
    write_markdown("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
