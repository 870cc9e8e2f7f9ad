"""Structured-output benchmark on the shipped tiny models (issue 39, "Bench").

    python bench/structured.py --out bench/results/structured-<machine>-<date>.md [--quick]

1. **Matcher cost per step.** The 23 cases of tests/structured_cases.py (20 JSON schemas, a regex,
   a choice list, a grammar) as one batch through the engine, per model: engine steps, the step
   time, the matchers' mask time (`Matcher.mask_seconds`, summed over every matcher and clone) and
   the commit filter's time (`CommitFilter.mask_frontier` + `.filter`, masked diffusion only), per
   step and as a share of the step.
2. **Engine throughput with structured requests mixed in.** 32 held-out task prompts, a share of
   0 / 25 / 100 % of them structured (the cases in turn), all submitted at once to the engine
   (`LLM.generate`) and one at a time (sequential): generated tokens/s, and engine ÷ sequential.
3. **Tasks in a JSON form.** Held-out problems of `remask.zoo.tasks`, answered in plain text and
   as `{"answer": "..."}` under the JSON schema; accuracy (`Problem.is_correct`, the scoring of
   remask/zoo/evaluate.py, on the plain text or on the parsed `answer`), and the share that finished
   with `stop`.

One intra-op thread (the tests' setting).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time
import warnings
from typing import Any

import torch

import remask
from remask.structured import CompiledStructure, Matcher
from remask.zoo import tasks

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from structured_cases import CASES  # noqa: E402  (tests/structured_cases.py)

MAX_TOKENS = 48
SETTINGS = {"tiny-ar": {}, "tiny-llada": {"block_length": 8, "steps": MAX_TOKENS}}
ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": tasks.MAX_ANSWER_CHARS}},
                 "required": ["answer"], "additionalProperties": False}


class Meter:
    """Counts engine steps and their time, every matcher's mask time and the commit filter's time
    while installed (methods wrapped; restored by `close`)."""

    def __init__(self) -> None:
        from remask.diffusion.parts.constrain import CommitFilter
        from remask.engine.llm_engine import LLMEngine

        self.steps = 0
        self.step_s = self.filter_s = 0.0
        self.matchers: list[Matcher] = []
        self.saved: list[tuple[Any, str, Any]] = []
        meter = self

        def timed(owner, name, attr):
            original = getattr(owner, name)
            self.saved.append((owner, name, original))

            def wrapper(*args, **kwargs):
                began = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    setattr(meter, attr, getattr(meter, attr) + time.perf_counter() - began)
                    if attr == "step_s":
                        meter.steps += 1
            setattr(owner, name, wrapper)

        def kept(owner, name):
            original = getattr(owner, name)
            self.saved.append((owner, name, original))

            def wrapper(*args, **kwargs):
                matcher = original(*args, **kwargs)
                meter.matchers.append(matcher)
                return matcher
            setattr(owner, name, wrapper)

        timed(LLMEngine, "step", "step_s")
        timed(CommitFilter, "mask_frontier", "filter_s")
        timed(CommitFilter, "filter", "filter_s")
        kept(CompiledStructure, "matcher")
        kept(Matcher, "clone")

    @property
    def mask_s(self) -> float:
        return sum(m.mask_seconds for m in self.matchers)

    def close(self) -> None:
        for owner, name, original in reversed(self.saved):
            setattr(owner, name, original)


def matcher_cost(llms: dict[str, Any], cases: list) -> list[dict[str, Any]]:
    rows = []
    for name, llm in llms.items():
        prompt = llm.chat_ids([{"role": "user", "content": "sort 3 1 2"}])
        params = [remask.SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=c.structured, **SETTINGS[name])
                  for c in cases]
        meter = Meter()
        try:
            began = time.perf_counter()
            outs = llm.generate([prompt] * len(cases), params, use_tqdm=False)
            wall = time.perf_counter() - began
        finally:
            meter.close()
        stops = sum(o.outputs[0].finish_reason == "stop" for o in outs)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = max(1, meter.steps)
        rows.append({"model": name, "requests": len(cases), "stop": f"{stops}/{len(cases)}", "engine steps": meter.steps,
                     "wall s": round(wall, 3), "step ms": round(1e3 * meter.step_s / steps, 2),
                     "mask ms/step": round(1e3 * meter.mask_s / steps, 3),
                     "filter ms/step": round(1e3 * meter.filter_s / steps, 3) if name != "tiny-ar" else "n/a",
                     "mask µs/token": round(1e6 * meter.mask_s / max(1, tokens), 1),
                     "mask + filter share of step": f"{100 * (meter.mask_s + (meter.filter_s if name != 'tiny-ar' else 0)) / max(1e-9, meter.step_s):.0f} %"})
        # (the filter's time includes the mask computations it makes: the share counts them once)
        if name != "tiny-ar":
            rows[-1]["mask + filter share of step"] = f"{100 * max(meter.mask_s, meter.filter_s) / max(1e-9, meter.step_s):.0f} %"
    return rows


def throughput(llms: dict[str, Any], n: int, cases: list) -> list[dict[str, Any]]:
    problems = tasks.problems(n, tasks.EVAL_SEED)
    rows = []
    for name, llm in llms.items():
        prompts = [llm.chat_ids([{"role": "user", "content": p.prompt}]) for p in problems]
        for share in (0, 25, 100):
            every = {0: None, 25: 4, 100: 1}[share]
            params = []
            for i in range(n):
                structured = cases[i % len(cases)].structured if every and i % every == 0 else None
                params.append(remask.SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=structured,
                                                    **SETTINGS[name]))
            began = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            engine_s = time.perf_counter() - began
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            began = time.perf_counter()
            seq = [llm.generate([p], q, use_tqdm=False)[0] for p, q in zip(prompts, params)]
            seq_s = time.perf_counter() - began
            same = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs, seq))
            rows.append({"model": name, "structured share": f"{share} %", "requests": n,
                         "engine tok/s": round(tokens / engine_s, 1), "sequential tok/s": round(tokens / seq_s, 1),
                         "engine ÷ sequential": round(seq_s / engine_s, 2), "answers equal sequential": same})
    return rows


def task_accuracy(llms: dict[str, Any], n: int) -> list[dict[str, Any]]:
    problems = tasks.problems(n, tasks.EVAL_SEED)
    rows = []
    for name, llm in llms.items():
        prompts = [llm.chat_ids([{"role": "user", "content": p.prompt}]) for p in problems]
        extra = {"block_length": 8} if name == "tiny-llada" else {}
        plain = llm.generate(prompts, remask.SamplingParams(max_tokens=16, **extra,
                                                             **({"steps": 16} if extra else {})), use_tqdm=False)
        shaped = llm.generate(prompts, remask.SamplingParams(max_tokens=MAX_TOKENS, structured_outputs={
            "json": ANSWER_SCHEMA}, **extra, **({"steps": MAX_TOKENS} if extra else {})), use_tqdm=False)
        plain_ok = sum(p.is_correct(o.outputs[0].text) for p, o in zip(problems, plain))
        json_ok = begins = stops = 0
        for p, o in zip(problems, shaped):
            c = o.outputs[0]
            if c.finish_reason == "stop":
                stops += 1
                answer = json.loads(c.text)["answer"]
                json_ok += p.is_correct(answer)
                begins += any(answer.startswith(a) for a in p.answers)
        rows.append({"model": name, "problems": n, "plain accuracy": f"{100 * plain_ok / n:.1f} %",
                     "JSON accuracy": f"{100 * json_ok / n:.1f} %",
                     "JSON answer begins with a correct one": f"{100 * begins / n:.1f} %",
                     "JSON stop share": f"{stops}/{n}",
                     "JSON answer e.g.": shaped[0].outputs[0].text})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "| " + " | ".join("---" for _ in keys) + " |"]
    lines += ["| " + " | ".join(str(r[k]).replace("|", "\\|") for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the markdown report here")
    parser.add_argument("--quick", action="store_true", help="a smoke run: few cases, few requests")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    began = time.perf_counter()
    llms = {name: remask.LLM(name) for name in SETTINGS}
    cases = CASES[:3] if args.quick else CASES
    cost = matcher_cost(llms, cases)
    speed = throughput(llms, 4 if args.quick else 32, cases)
    accuracy = task_accuracy(llms, 4 if args.quick else 128)
    report = "\n".join([
        f"# Structured output bench ({datetime.date.today()}, {platform.machine()} CPU, {args.threads} thread(s), "
        f"torch {torch.__version__})", "",
        f"`python bench/structured.py{' --quick' if args.quick else ''}` — {time.perf_counter() - began:.0f} s in all.",
        "Greedy decoding; tiny-llada with blocks of 8, one token a step.", "",
        "## Matcher cost per engine step (the structure cases in one batch)", "",
        "Mask time: llguidance's `compute_bitmask` and its conversion to a vocabulary mask "
        "(`Matcher.mask_seconds`). Filter time: the commit filter's frontier masking and its check of "
        "every commit (it includes the mask time of the masks it computes).", "",
        table(cost), "",
        "## Engine throughput with structured requests mixed in", "",
        f"Every request up to {MAX_TOKENS} tokens (tiny-llada: {MAX_TOKENS} steps, blocks of 8), structured or "
        "not; tok/s counts the tokens returned (an answer's end tokens not counted: a structured answer that "
        "ends early returns fewer). Engine ÷ sequential: the same requests' wall time one at a time over "
        "the engine's.", "",
        table(speed), "",
        "## The shipped tasks in a JSON form `{\"answer\": ...}`", "",
        "Plain: the answer text as it is; JSON: the `answer` of the parsed object (a `length` answer "
        "counts as wrong). The tiny models never saw JSON in training: inside the string they do not "
        "learn to close it, and write on to its `maxLength`; the last column counts answers that begin "
        "with a correct one.", "",
        table(accuracy), ""])
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return report


if __name__ == "__main__":
    print(main())
