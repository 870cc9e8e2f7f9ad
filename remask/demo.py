"""`python -m remask.demo`: watch remask's tiny trained diffusion model unmask answers, then compare
decoding strategies on held-out problems.

The model is `tiny-llada` (shipped with the package: a 0.9M-parameter masked-diffusion model in
the official LLaDA checkpoint format, trained by `python -m remask.zoo.train`); the AR row uses
`tiny-ar` (a Llama with the same tokenizer). Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import remask
from remask.zoo import charset, checkpoint_path, load
from remask.zoo.evaluate import GEN_LENGTH, Strategy, decode_batch, evaluate
from remask.zoo.tasks import EVAL_SEED, MULTI_ANSWER_TASKS, problems

MASK_GLYPH = "·"
EOS_GLYPH = "∎"
SHOWCASE = ("sort 52814", "reverse remask", "greet Ada", "capital of Peru", "name a colour")

STRATEGIES = (
    Strategy.of("LLaDA low-confidence, 1 token/step", steps=16),
    Strategy.of("LLaDA low-confidence, 4 tokens/step", steps=4),
    Strategy.of("LLaDA random remasking, 1 token/step", steps=16, remasking="random"),
    Strategy.of("Fast-dLLM threshold 0.9", steps=16, threshold=0.9),
    Strategy.of("Fast-dLLM factor 1.0", steps=16, factor=1.0),
    # The dual cache keeps the prompt's K/V from each block start: on this model it turns "fox"
    # into "cot" on the animal task (Fast-dLLM's own code does the same, tests/test_cache.py).
    Strategy.of("Fast-dLLM 0.9 + dual cache, blocks of 8", steps=16, block_length=8, threshold=0.9,
                use_cache="dual"),
    # APD: the diffusion model drafts the answer left to right, tiny-ar keeps the longest prefix the
    # mixture R·dLLM + (1 − R)·AR agrees with (the verifier's forwards are the last column).
    Strategy.of("APD R=0.7 + tiny-ar verifier", apd=dict(mixture_weight=0.7, kv_window=16, max_lookahead=16)),
    Strategy.of("AR model (tiny-ar), greedy", ar=True),
)


def glyph(token: int) -> str:
    if token == charset.MASK_ID:
        return MASK_GLYPH
    if token in (charset.EOS_ID, charset.EOT_ID):
        return EOS_GLYPH
    text = charset.VOCAB[token] if token < len(charset.VOCAB) else "?"
    return "␣" if text == " " else text if len(text) == 1 else "?"


def render(answer: torch.Tensor, fresh: torch.Tensor, color: bool) -> str:
    """One line per step: each answer position, the ones revealed at this step highlighted."""
    cells = []
    for token, new in zip(answer.tolist(), fresh.tolist()):
        g = glyph(token)
        if new:
            cells.append(f"\033[1;32m{g}\033[0m" if color else f"[{g}]")
        else:
            cells.append(g if color else f" {g} ")
    return ("" if color else "").join(cells)


def show_unmasking(model, prompt: str, strategy: Strategy, pause: float, color: bool) -> None:
    from remask.zoo.tasks import Problem

    print(f"\n{prompt!r} — {strategy.name}")
    step = 0

    def on_step(block, x, transfer):
        nonlocal step
        step += 1
        positions = [int(i) for i in torch.nonzero(transfer[0, -GEN_LENGTH:]).flatten()]
        print(f"  step {step:2d} | {render(x[0, -GEN_LENGTH:], transfer[0, -GEN_LENGTH:], color)} |"
              f" reveals {positions}", flush=True)
        if pause:
            time.sleep(pause)

    problem = Problem("demo", prompt, (), "")
    answer = decode_batch(model, [problem], strategy, GEN_LENGTH, torch.Generator().manual_seed(0),
                          remask.GenerationStats(), on_step=on_step)
    print(f"  answer: {charset.decode_answer(answer[0])!r}")


def strategy_table(models: dict[str, torch.nn.Module], n: int, show_progress: bool) -> list:
    from tqdm.auto import tqdm

    held_out = problems(n, EVAL_SEED)
    rows = []
    for strategy in STRATEGIES:
        model = models["ar" if strategy.ar else "diffusion"]
        with tqdm(total=n, desc=f"{strategy.name[:36]:36s}", leave=False, disable=not show_progress,
                  file=sys.stderr) as bar:
            rows.append(evaluate(model, held_out, strategy, progress=bar.update, verifier=models["ar"]))
    print(f"\n{n} held-out problems ({', '.join(sorted({p.task for p in held_out}))}); "
          f"exact match (multi-answer tasks: membership)\n")
    header = (f"{'strategy':40s} {'accuracy':>8s} {'multi-answer':>12s} {'NFE/answer':>10s} {'tokens/s':>9s}"
              f" {'verifier NFE':>12s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        multi_acc = sum(r.per_task[t] for t in MULTI_ANSWER_TASKS if t in r.per_task) / max(
            1, sum(t in r.per_task for t in MULTI_ANSWER_TASKS))
        verifier_nfe = f"{r.verifier_nfe_per_answer:12.1f}" if r.verifier_nfe_per_answer else f"{'':12s}"
        print(f"{r.strategy:40s} {r.accuracy:8.1%} {multi_acc:12.1%} {r.nfe_per_answer:10.1f} {r.tokens_per_second:9.0f}"
              f" {verifier_nfe}")
    print("\nNFE/answer: model forwards per answer (batch 1). tokens/s: answer positions decoded per second "
          "(16 per answer for diffusion and APD; up to EOS for AR), this machine, 1 thread. verifier NFE: "
          "the AR verifier's forwards per answer (APD).")
    return rows


def structured_section() -> None:
    """The shipped chat model (`tiny-ar-chat`) answering as JSON under a schema, and calling tools whose results
    it then answers from: what `remask serve` does for `response_format` and `tools` (both enforced)."""
    from remask.structured import StructuredOutputsParams, tool_call_spec
    from remask.zoo.formats import TOOLS

    llm = remask.LLM("tiny-ar-chat")
    params = remask.SamplingParams(max_tokens=64)
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"],
              "additionalProperties": False}
    ask = [{"role": "user", "content": "sort 52814"}]
    reply = llm.chat(ask, params.replace(structured_outputs=StructuredOutputsParams(json=schema)), use_tqdm=False,
                     response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    print(f"\nStructured output (tiny-ar-chat, greedy; `remask serve` holds answers to the same structures):\n"
          f"  {ask[0]['content']!r} as JSON, schema {{answer: str}} → {reply[0].outputs[0].text}")
    tools = [TOOLS["add"], TOOLS["capital"]]
    spec = tool_call_spec(tools, "auto")
    ask = [{"role": "user", "content": "4+2 and capital of Italy"}]
    text = llm.chat(ask, params.replace(max_tokens=128, structured_outputs=spec.structure), use_tqdm=False,
                    tools=tools)[0].outputs[0].text
    calls = spec.calls_of(text) or []
    print(f"  {ask[0]['content']!r} with tools add, capital → calls "
          + ", ".join(f"{c['name']}({c['arguments']})" for c in calls))
    run = {"add": lambda a, b: a + b, "capital": lambda country: {"Italy": "Rome"}.get(country, "unknown")}
    results = [str(run[c["name"]](**json.loads(c["arguments"]))) for c in calls]
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": c} for i, c in enumerate(calls)]}] + [
        {"role": "tool", "tool_call_id": f"call_{i}", "content": r} for i, r in enumerate(results)]
    final = llm.chat(history, params.replace(max_tokens=128, structured_outputs=spec.structure), use_tqdm=False,
                     tools=tools)[0].outputs[0].text
    with open(os.path.join(checkpoint_path("tiny-ar-chat"), "metrics.json")) as f:
        rate = json.load(f)["held_out"]["strategies"][0]["tool_answer"]["accuracy"]
    print(f"  the tools returned {results} → answer {final!r} (right after a tool result on {rate:.0%} of held-out "
          "conversations: docs/models.md, the chat models)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m remask.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--non-interactive", action="store_true",
                        help="no pauses, no colours, no progress bars (for CI and logs)")
    parser.add_argument("--problems", type=int, default=100, help="held-out problems in the strategy table")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if args.problems <= 0:
        raise SystemExit(f"--problems must be positive, got {args.problems}")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # transformers' per-load weight bars; ours stay
    interactive = not args.non_interactive and sys.stdout.isatty()

    model, _ = load("tiny-llada")
    ar_model, _ = load("tiny-ar")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"remask demo — tiny-llada: {n_params / 1e6:.1f}M-parameter masked-diffusion model (official LLaDA "
          f"format), trained on toy tasks by `python -m remask.zoo.train`.")
    print(f"Answers have {GEN_LENGTH} positions; {MASK_GLYPH} = still masked, {EOS_GLYPH} = EOS, "
          f"{'green' if interactive else '[x]'} = revealed at this step.")
    pause = 0.12 if interactive else 0.0
    for prompt in SHOWCASE:
        show_unmasking(model, prompt, STRATEGIES[0], pause, color=interactive)
    show_unmasking(model, "sort 52814", STRATEGIES[3], pause, color=interactive)
    strategy_table({"diffusion": model, "ar": ar_model}, args.problems, show_progress=not args.non_interactive)
    structured_section()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
