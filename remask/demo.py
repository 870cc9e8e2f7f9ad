"""`python -m remask.demo`: watch a diffusion LLM unmask an answer, then compare strategies.

Until remask ships its tiny trained checkpoints, the demo builds a tiny *random* LLaDA in the
official checkpoint format on the fly: the unmasking order and the speed/NFE figures are real,
the tokens are not language.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

import remask
from remask.models import tiny

MASK_GLYPH = "·"


def build_model(workdir: str) -> torch.nn.Module:
    from transformers import AutoModel

    path = os.path.join(workdir, "tiny-random-llada")
    tiny.write_tiny_llada(path, seed=0, vocab_size=300, embedding_size=300, mask_token_id=299, eos_token_id=298,
                          pad_token_id=297, n_layers=2, d_model=64, mlp_hidden_size=128)
    return AutoModel.from_pretrained(path).eval()


def render(x: torch.Tensor, prompt_len: int, mask_id: int, fresh: torch.Tensor) -> str:
    cells = []
    for i in range(prompt_len, x.shape[0]):
        tok = int(x[i])
        cell = MASK_GLYPH if tok == mask_id else f"{tok:x}"
        cells.append(f"[{cell}]" if bool(fresh[i]) else f" {cell} ")
    return "".join(f"{c:>5}" for c in cells)


def show_unmasking(model, prompt, gen_length, block_length, steps, interactive: bool) -> None:
    mask_id = remask.get_spec(model).mask_id
    print(f"prompt ids: {prompt[0].tolist()}  (answer tokens shown in hex, [x] = revealed this step)")

    def on_step(block, x, transfer):
        print(f"block {block} | " + render(x[0], prompt.shape[1], mask_id, transfer[0]))
        if interactive:
            time.sleep(0.15)

    remask.generate(model, prompt, steps=steps, gen_length=gen_length, block_length=block_length, on_step=on_step)


STRATEGIES = [
    ("LLaDA low-confidence, 1 token/step", dict(remasking="low_confidence")),
    ("LLaDA random remasking", dict(remasking="random")),
    ("Fast-dLLM threshold 0.9", dict(threshold=0.9)),
    ("Fast-dLLM threshold 0.3", dict(threshold=0.3)),
    ("Fast-dLLM factor 2.0", dict(factor=2.0)),
]


def strategy_table(model, prompts: torch.Tensor, gen_length: int, block_length: int) -> None:
    print(f"\n{'strategy (batch of ' + str(prompts.shape[0]) + ')':40s} {'NFE':>5s} {'tok/step/row':>12s} "
          f"{'gen tok/s':>10s}   accuracy")
    for name, kw in STRATEGIES:
        kw = {"steps": gen_length, **kw}
        stats = remask.GenerationStats()
        remask.generate(model, prompts, gen_length=gen_length, block_length=block_length, stats=stats,
                        generator=torch.Generator().manual_seed(0), **kw)
        print(f"{name:40s} {stats.nfe:5d} {stats.mean_tokens_per_step / prompts.shape[0]:12.2f} "
              f"{stats.tokens_per_second:10.1f}   n/a (random weights)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--non-interactive", action="store_true", help="no pauses between steps (for CI)")
    parser.add_argument("--gen-length", type=int, default=16)
    parser.add_argument("--block-length", type=int, default=8)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print("remask demo — model: a tiny RANDOM LLaDA built on the fly (official checkpoint format; shipped "
          "trained checkpoints come later), so tokens are meaningless; order, NFE and speed are real.\n")
    with tempfile.TemporaryDirectory() as workdir:
        model = build_model(workdir)
        prompt = torch.randint(0, 290, (1, 6), generator=torch.Generator().manual_seed(1))
        show_unmasking(model, prompt, args.gen_length, args.block_length, args.gen_length,
                       interactive=not args.non_interactive and sys.stdout.isatty())
        prompts = torch.randint(0, 290, (4, 6), generator=torch.Generator().manual_seed(2))
        strategy_table(model, prompts, args.gen_length, args.block_length)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
