"""Block-diffusion decoders on random models: forwards per token and tokens/s, with the exact KV cache
and without it, and the engine's shared forwards — all measured in the same run.

    python bench/block_diffusion.py --out bench/results/block-diffusion-<machine>-<date>.md

For each family (SDAR, SDAR-MoE, and every other block-diffusion family registered in `CASES`),
a random checkpoint in the official format (`remask.models.tiny`, widened by `--hidden`) decodes the
same prompts with its drop-in entry point twice: with the exact cache (finished blocks stored once)
and without a cache (each step forwards the whole sequence up to the current block). The tokens are
checked equal before anything is reported. Then `remask.LLM` serves `--requests` requests of the
family together (requests at different blocks share one forward per step; finished blocks in the
engine's pages) against the same requests run one after another.

Tokens of a random model mean nothing: only forwards, positions computed and times are reported.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM

import remask
from remask.models import tiny

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import write_markdown  # noqa: E402  (bench/report.py)


def sdar_case(moe: bool) -> dict[str, Any]:
    from remask.compat.sdar import block_diffusion_generate

    def build(folder: str, hidden: int) -> torch.nn.Module:
        writer = tiny.write_tiny_sdar_moe if moe else tiny.write_tiny_sdar
        writer(folder, seed=0, hidden_size=hidden, intermediate_size=2 * hidden, head_dim=hidden // 4,
               num_hidden_layers=4, vocab_size=2048, mask_token_id=2047, eos_token_id=2046, bos_token_id=2046,
               **({"moe_intermediate_size": hidden // 2} if moe else {}))
        return AutoModelForCausalLM.from_pretrained(folder).eval()

    def run(model, prompt: torch.Tensor, gen_length: int, use_cache: bool, stats) -> torch.Tensor:
        return block_diffusion_generate(model, {"input_ids": prompt}, 2047, gen_length=gen_length, block_length=4,
                                        denoising_steps=4, temperature=0.0,
                                        remasking_strategy="low_confidence_dynamic", confidence_threshold=0.9,
                                        use_cache=use_cache, stats=stats)

    params = remask.SamplingParams(temperature=0.0, threshold=0.9, decoder=remask.SDARDecoding(denoising_steps=4))
    return {"name": "SDAR-MoE" if moe else "SDAR", "build": build, "run": run, "engine_params": params,
            "setting": "blocks of 4, 4 steps, low_confidence_dynamic 0.9, greedy"}


def llada2_case(editing: bool) -> dict[str, Any]:
    from remask.compat.llada2 import generate

    def build(folder: str, hidden: int) -> torch.nn.Module:
        tiny.write_tiny_llada2(folder, seed=0, hidden_size=hidden, intermediate_size=2 * hidden, head_dim=hidden // 4,
                               rotary_dim=hidden // 8, moe_intermediate_size=hidden // 2, num_hidden_layers=4,
                               vocab_size=2048, mask_token_id=2047, eos_token_id=2046, pad_token_id=2046)
        return AutoModelForCausalLM.from_pretrained(folder).eval()

    extra = dict(editing_threshold=0.5, max_post_steps=4) if editing else {}

    def run(model, prompt: torch.Tensor, gen_length: int, use_cache: bool, stats) -> torch.Tensor:
        # eos_id outside what a random model predicts: every run decodes gen_length tokens
        return generate(model, prompt, gen_length=gen_length, block_length=8, steps=8, threshold=0.7,
                        eos_id=2046, use_cache=use_cache, stats=stats, **extra)

    return {"name": "LLaDA2.1 (editing)" if editing else "LLaDA2.0", "build": build, "run": run,
            "engine_params": remask.SamplingParams(temperature=0.0, threshold=0.7,
                                                   decoder=remask.LLaDA2Decoding(block_length=8, steps=8, **extra)),
            "setting": "blocks of 8, 8 steps, threshold 0.7" + (", editing 0.5, 4 post steps" if editing else "")
            + ", greedy"}


def fast_dllm_v2_case() -> dict[str, Any]:
    from remask.compat.fast_dllm_v2 import generate

    def build(folder: str, hidden: int) -> torch.nn.Module:
        tiny.write_tiny_fast_dllm_v2(folder, seed=0, hidden_size=hidden, intermediate_size=2 * hidden,
                                     num_hidden_layers=4, layer_types=["full_attention"] * 4, max_window_layers=4,
                                     vocab_size=2048, mask_token_id=2047, eos_token_id=2046, pad_token_id=2046,
                                     bos_token_id=2045, bd_size=32)
        return AutoModelForCausalLM.from_pretrained(folder).eval()

    def run(model, prompt: torch.Tensor, gen_length: int, use_cache: bool, stats) -> torch.Tensor:
        # the official loop always keeps its prefix cache; use_cache here is its sub-block cache
        return generate(model, prompt, max_new_tokens=gen_length, mask_id=2047, stop_token=2046, block_size=32,
                        small_block_size=8, threshold=0.9, use_block_cache=use_cache, stats=stats)[:, prompt.shape[1]:]

    return {"name": "Fast-dLLM v2", "build": build, "run": run, "same_tokens": False,
            "cache_names": ("prefix + sub-block cache", "prefix cache"),
            "engine_params": remask.SamplingParams(temperature=0.0, threshold=0.9,
                                                   decoder=remask.FastDLLMV2Decoding(block_size=32, small_block_size=8)),
            "setting": "blocks of 32, sub-blocks of 8, threshold 0.9, greedy (its loop always has the prefix "
                       "cache; the comparison is its use_block_cache)"}


# family name → case builder; other block-diffusion families add theirs here
CASES: dict[str, Callable[[], dict[str, Any]]] = {
    "sdar": lambda: sdar_case(False),
    "sdar_moe": lambda: sdar_case(True),
    "llada2": lambda: llada2_case(False),
    "llada2_editing": lambda: llada2_case(True),
    "fast_dllm_v2": fast_dllm_v2_case,
}


def measure(case: dict[str, Any], model, prompts: list[list[int]], gen_length: int) -> tuple[list[str], dict]:
    rows, outputs = [], {}
    for use_cache in (True, False):
        stats = remask.GenerationStats()
        start = time.perf_counter()
        outs = []
        for prompt in prompts:
            outs.append(case["run"](model, torch.tensor([prompt]), gen_length, use_cache, stats)[0].tolist())
        elapsed = time.perf_counter() - start
        outputs[use_cache] = outs
        tokens = gen_length * len(prompts)
        rows.append((use_cache, stats.nfe / tokens, stats.forward_positions / tokens, tokens / elapsed))
    if case.get("same_tokens", True) and outputs[True] != outputs[False]:
        raise AssertionError(f"{case['name']}: cached and uncached tokens differ")
    same = "same tokens" if outputs[True] == outputs[False] else "tokens differ (an approximate cache)"
    cached_name, uncached_name = case.get("cache_names", ("exact cache", "no cache"))
    speedup = rows[0][3] / rows[1][3]
    lines = [f"| {case['name']} | {cached_name if c else uncached_name} | {nfe:.2f} | {pos:.1f} | {tps:.1f} | "
             + (f"{speedup:.2f}× | {same} |" if c else "1.00× | |")
             for c, nfe, pos, tps in rows]
    return lines, outputs


def engine_rows(case: dict[str, Any], model, prompts: list[list[int]], gen_length: int) -> list[str]:
    params = case["engine_params"]
    params = remask.SamplingParams(**{**{f: getattr(params, f) for f in params.__dataclass_fields__},
                                      "max_tokens": gen_length})
    llm = remask.LLM(model)
    start = time.perf_counter()
    one_by_one = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    t_alone = time.perf_counter() - start
    forwards_alone = llm.engine.runner.forwards
    llm = remask.LLM(model)
    start = time.perf_counter()
    together = llm.generate(prompts, params, use_tqdm=False)
    t_together = time.perf_counter() - start
    if [o.outputs[0].all_token_ids for o in together] != [o.outputs[0].all_token_ids for o in one_by_one]:
        raise AssertionError(f"{case['name']}: the engine's tokens depend on the batch")
    tokens = sum(len(o.outputs[0].all_token_ids) for o in together)
    return [f"| {case['name']} | one by one | {forwards_alone} | {tokens / t_alone:.1f} | 1.00× |",
            f"| {case['name']} | {len(prompts)} together | {llm.engine.runner.forwards} | {tokens / t_together:.1f} | "
            f"{t_alone / t_together:.2f}× |"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/block_diffusion.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prompt-length", type=int, default=61)
    parser.add_argument("--gen-length", type=int, default=64)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--families", default=",".join(CASES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 2000, (args.prompt_length + i,), generator=gen).tolist() for i in range(args.requests)]
    command = " ".join(["python bench/block_diffusion.py"] + (argv if argv is not None else sys.argv[1:]))
    lines = [f"# Block-diffusion decoders: {platform.machine()} CPU, {args.threads} thread(s), "
             f"{datetime.date.today().isoformat()}", "",
             f"torch {torch.__version__}; command: `{command}`. No GPU was available. Random checkpoints in the "
             f"official formats (hidden {args.hidden}, 4 layers, vocabulary 2048), prompts of "
             f"{args.prompt_length}–{args.prompt_length + args.requests - 1} tokens, {args.gen_length} new tokens.", "",
             "## Exact cache vs no cache (the drop-in entry point, one prompt at a time)", "",
             "Tokens checked equal in the same run (where the cache is exact).", "",
             "| family | cache | forwards per token | positions computed per token | tokens/s | speed-up | tokens |",
             "| --- | --- | ---: | ---: | ---: | ---: | --- |"]
    engine_lines = ["", f"## The engine: {args.requests} requests together vs one by one", "",
                    "Requests at different blocks share one forward per step; tokens checked equal.", "",
                    "| family | run | forwards | tokens/s | speed-up |", "| --- | --- | ---: | ---: | ---: |"]
    for name in args.families.split(","):
        case = CASES[name]()
        with tempfile.TemporaryDirectory() as folder:
            model = case["build"](folder, args.hidden)
            rows, _ = measure(case, model, prompts[:3], args.gen_length)
            lines += rows
            print("\n".join(rows), flush=True)
            if case.get("engine_params") is not None:
                rows = engine_rows(case, model, prompts, args.gen_length)
                engine_lines += rows
                print("\n".join(rows), flush=True)
    settings = ["", "Settings: " + "; ".join(f"{CASES[n]()['name']}: {CASES[n]()['setting']}"
                                              for n in args.families.split(",")) + "."]
    write_markdown("\n".join(lines + engine_lines + settings) + "\n", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
