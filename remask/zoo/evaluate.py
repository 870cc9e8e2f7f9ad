"""Score decoding strategies on held-out problems: exact match, NFE per answer, tokens/s.

Used by the demo, the ablation CLI (`bench/ablate.py`), the training script's final report and
the tests, so every figure in docs/ comes from the same code.

    >>> from remask.zoo import load
    >>> from remask.zoo.evaluate import Strategy, evaluate
    >>> from remask.zoo.tasks import EVAL_SEED, problems
    >>> model, _ = load("tiny-llada")
    >>> result = evaluate(model, problems(7, EVAL_SEED), Strategy("1 token/step", steps=16))
    >>> result.accuracy >= 0.5, result.nfe_per_answer
    (True, 16.0)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from remask.diffusion import APDConfig, GenerationStats, ar_generate, generate
from remask.models import get_spec
from remask.zoo import charset
from remask.zoo.tasks import Problem

GEN_LENGTH = 16


@dataclass(frozen=True)
class Strategy:
    """One decoding setting. `ar=True` decodes with `remask.ar_generate` (greedy unless a
    temperature is given); otherwise `remask.generate` with `steps`, `block_length` (default:
    the whole answer) and any other keyword of it in `options` (remasking, threshold, factor,
    temperature, cfg_scale, …). `apd` in `options` is a dict of `APDConfig` fields other than the
    verifier (`mixture_weight`, `max_lookahead`, …); `evaluate`'s `verifier` model fills that in."""

    name: str
    steps: int | None = None
    block_length: int | None = None
    ar: bool = False
    options: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def of(name: str, **kw: Any) -> "Strategy":
        steps, block, ar = kw.pop("steps", None), kw.pop("block_length", None), kw.pop("ar", False)
        return Strategy(name, steps, block, ar, kw)


@dataclass
class EvalResult:
    strategy: str
    n: int
    accuracy: float
    per_task: dict[str, float]
    nfe_per_answer: float
    tokens_per_second: float
    seconds: float
    outputs: list[str]
    verifier_nfe_per_answer: float = 0.0


def prompt_batch(batch: Sequence[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded chat prompts `[B, P]` and their padding mask (1 = token)."""
    encoded = [charset.encode_chat(p.prompt) for p in batch]
    P = max(len(e) for e in encoded)
    ids = torch.full((len(batch), P), charset.PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(batch), P), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, P - len(e):] = torch.tensor(e)
        mask[i, P - len(e):] = 1
    return ids, mask


def decode_batch(model: torch.nn.Module, batch: Sequence[Problem], strategy: Strategy, gen_length: int,
                 generator: torch.Generator, stats: GenerationStats,
                 on_step: Callable | None = None, verifier: torch.nn.Module | None = None,
                 verifier_stats: GenerationStats | None = None) -> torch.Tensor:
    """Answer ids `[B, gen_length]` of one batch under `strategy` (`verifier`: the AR model of an
    APD strategy, whose forwards go to `verifier_stats`)."""
    ids, mask = prompt_batch(batch)
    attention_mask = mask if bool((mask == 0).any()) else None
    options = dict(strategy.options)
    if isinstance(options.get("apd"), dict):
        if verifier is None:
            raise ValueError(f"strategy {strategy.name!r} uses APD: pass verifier= (an AR model with the same tokenizer)")
        options["apd"] = APDConfig(verifier=verifier, **options["apd"])
        options["verifier_stats"] = verifier_stats
    if strategy.ar:
        out = ar_generate(model, ids, attention_mask=attention_mask, max_new_tokens=gen_length,
                                 generator=generator, stats=stats, **strategy.options)
    elif "apd" in options:   # APD decodes left to right with its verifier: steps or blocks given are refused
        layout = {k: v for k, v in (("steps", strategy.steps), ("block_length", strategy.block_length)) if v}
        out = generate(model, ids, attention_mask, gen_length=gen_length, generator=generator, stats=stats,
                       on_step=on_step, **layout, **options)
    else:
        steps = strategy.steps or gen_length
        block = strategy.block_length or gen_length
        out = generate(model, ids, attention_mask, steps=steps, gen_length=gen_length, block_length=block,
                              generator=generator, stats=stats, on_step=on_step, **options)
    return out[:, ids.shape[1]:]


@torch.no_grad()
def evaluate(model: torch.nn.Module, problems: Sequence[Problem], strategy: Strategy, *,
             gen_length: int = GEN_LENGTH, batch_size: int = 1, seed: int = 0,
             progress: Callable[[int], None] | None = None, verifier: torch.nn.Module | None = None) -> EvalResult:
    """Decode every problem and score it. With `batch_size=1` (the default) the NFE per answer is
    exact; with larger batches a batch's forwards count for each of its rows. `verifier`: the AR
    model of APD strategies; its forwards are counted separately (`verifier_nfe_per_answer`)."""
    generator = torch.Generator().manual_seed(seed)
    outputs: list[str] = []
    nfe = generated = verifier_nfe = 0
    seconds = 0.0
    for start in range(0, len(problems), batch_size):
        batch = problems[start:start + batch_size]
        stats, verifier_stats = GenerationStats(), GenerationStats()
        t0 = time.perf_counter()
        answer_ids = decode_batch(model, batch, strategy, gen_length, generator, stats, verifier=verifier,
                                  verifier_stats=verifier_stats)
        seconds += time.perf_counter() - t0
        nfe += stats.nfe * len(batch)
        verifier_nfe += verifier_stats.nfe * len(batch)
        generated += stats.generated_tokens
        outputs.extend(charset.decode_answer(row) for row in answer_ids)
        if progress is not None:
            progress(len(batch))
    correct = [p.is_correct(o) for p, o in zip(problems, outputs)]
    per_task: dict[str, list[bool]] = {}
    for p, ok in zip(problems, correct):
        per_task.setdefault(p.task, []).append(ok)
    return EvalResult(strategy=strategy.name, n=len(problems), accuracy=sum(correct) / max(1, len(correct)),
                      per_task={t: sum(v) / len(v) for t, v in per_task.items()},
                      nfe_per_answer=nfe / max(1, len(problems)),
                      tokens_per_second=generated / seconds if seconds > 0 else 0.0, seconds=seconds,
                      outputs=outputs, verifier_nfe_per_answer=verifier_nfe / max(1, len(problems)))


def held_out_report(folder: str, n: int, gen_length: int = GEN_LENGTH) -> dict[str, Any]:
    """Accuracy of the model in `folder` on `n` held-out problems: one token per step for a
    diffusion model, greedy decoding for an AR model."""
    from remask.zoo import load
    from remask.zoo.tasks import EVAL_SEED, problems

    model, _ = load(folder)
    ar = get_spec(model).kind == "ar"
    strategy = Strategy("greedy AR", ar=True) if ar else Strategy("1 token/step", steps=gen_length)
    result = evaluate(model, problems(n, EVAL_SEED), strategy, gen_length=gen_length)
    return {"strategy": strategy.name, "n": n, "accuracy": round(result.accuracy, 4),
            "per_task": {k: round(v, 4) for k, v in result.per_task.items()}}
