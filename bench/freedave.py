"""FreeDave's forwards per generated token against one-token-per-step decoding (the tokens checked
equal in the same run), on the shipped tiny-llada, for each cache mode and draft count, and on tiny
random block-causal checkpoints (SDAR, SDAR-MoE, LLaDA2.0; their loops with the exact block cache).

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
    lines += block_causal_rows(args.gen_length)
    write_markdown("\n".join(lines) + "\n", args.out)
    return 0


def block_causal_rows(gen_length: int) -> list[str]:
    """The same table for the block-causal families' loops (greedy, one token per step, block 8,
    the exact cache), on tiny random checkpoints in the official formats, 3 prompts each; per token
    generated (Fast-dLLM v2 answers whole blocks, and stops at its stop token)."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from remask.compat.llada2 import generate as llada2_generate
    from remask.compat.sdar import block_diffusion_generate
    from remask.models import get_spec, tiny

    G, L = gen_length, 8
    prompts = [torch.randint(0, 250, (1, n), generator=torch.Generator().manual_seed(n)) for n in (3, 6, 11)]
    lines = ["", f"Block-causal loops: tiny random checkpoints (seed 0), 3 prompts, gen_length {G}, block {L}, "
             "the exact block cache; forwards include the prefill and the block stores.", "",
             "| family | one token per step | K = 2 | K = 4 | K = 8 |", "| --- | ---: | ---: | ---: | ---: |"]
    from remask.compat.fast_dllm_v2 import generate as fast_dllm_v2_generate

    for name, writer in (("SDAR", tiny.write_tiny_sdar), ("SDAR-MoE", tiny.write_tiny_sdar_moe),
                         ("LLaDA2.0", tiny.write_tiny_llada2), ("Fast-dLLM v2", tiny.write_tiny_fast_dllm_v2)):
        with tempfile.TemporaryDirectory() as path:
            writer(path, seed=0)
            model = AutoModelForCausalLM.from_pretrained(path).eval()
        mask = get_spec(model).mask_id
        if name == "Fast-dLLM v2":   # its generate: sub-blocks of 4, threshold 1 (one token per step)
            def run(p, **kw):
                return fast_dllm_v2_generate(model, p, max_new_tokens=G, block_size=L, small_block_size=4,
                                             threshold=1.0, mask_id=mask, stop_token=mask - 1, **kw)
        elif name == "LLaDA2.0":
            def run(p, **kw):   # the prompt, then the continuation (as the other loops return)
                return torch.cat([p, llada2_generate(model, p, gen_length=G, block_length=L, steps=L, threshold=1.0,
                                                     eos_id=None, **kw)], dim=1)
        else:
            def run(p, **kw):
                return block_diffusion_generate(model, {"input_ids": p}, mask, gen_length=G, block_length=L,
                                                denoising_steps=L, temperature=0.0,
                                                remasking_strategy="low_confidence_static", **kw)
        base = remask.GenerationStats()
        outs = [run(p, stats=base) for p in prompts]
        generated = sum(min(o.shape[1] - p.shape[1], G) for o, p in zip(outs, prompts))
        row = [f"{base.nfe / generated:.3f}"]
        for draft_steps in (2, 4, 8):
            stats = remask.GenerationStats()
            for p, expected in zip(prompts, outs):
                if not torch.equal(run(p, stats=stats, decoder=remask.FreeDave(draft_steps=draft_steps)), expected):
                    raise AssertionError(f"FreeDave differs from one token per step ({name})")
            row.append(f"{stats.nfe / generated:.3f}")
        lines.append(f"| {name} | " + " | ".join(row) + " |")
        print(lines[-1], flush=True)
    return lines


if __name__ == "__main__":
    sys.exit(main())
