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


def left_padded(encoded: Sequence[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists left-padded into `[B, P]`, and their padding mask (1 = token)."""
    P = max(len(e) for e in encoded)
    ids = torch.full((len(encoded), P), charset.PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(encoded), P), dtype=torch.long)
    for i, e in enumerate(encoded):
        ids[i, P - len(e):] = torch.tensor(e)
        mask[i, P - len(e):] = 1
    return ids, mask


def prompt_batch(batch: Sequence[Problem]) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded chat prompts `[B, P]` and their padding mask (1 = token)."""
    return left_padded([charset.encode_chat(p.prompt) for p in batch])


def chat_prompt_batch(examples: Sequence[Any], tokenizer: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`prompt_batch` for `remask.zoo.formats.Example`s: each conversation (messages, tools,
    response_format) through the chat models' template, left-padded `[B, P]`, and its mask."""
    tokenizer = charset.chat_tokenizer() if tokenizer is None else tokenizer
    return left_padded([chat_prompt_ids(e, tokenizer) for e in examples])


def chat_prompt_ids(example: Any, tokenizer: Any) -> list[int]:
    """The ids the server gives the model for `example` (the chat template, generation prompt appended)."""
    extra = {} if example.response_format is None else {"response_format": example.response_format}
    out = tokenizer.apply_chat_template(list(example.messages), tools=list(example.tools) if example.tools else None,
                                        add_generation_prompt=True, tokenize=True, **extra)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


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


# ---- the chat models: every format ------------------------------------------------------------

CHAT_GEN_LENGTHS = {"plain": 16, "json": 64, "json_object": 64, "tool_call": 128, "tool_answer": 128,
                    "tool_text": 128}


def chat_strategies(ar: bool) -> list[Strategy]:
    """The decodings a chat model's metrics report: greedy (AR); one token per step and
    Fast-dLLM's threshold 0.9 with the dual cache in blocks of 32 (diffusion)."""
    if ar:
        return [Strategy("greedy AR", ar=True)]
    return [Strategy("1 token/step"), Strategy.of("threshold 0.9 + dual cache", block_length=32, threshold=0.9,
                                                  use_cache="dual")]


def structure_of(example: Any) -> Any:
    """What the server enforces for `example`: its JSON schema (`json_object`: any object), the
    `auto` tool grammar when tools are offered, else None."""
    from remask.structured import StructuredOutputsParams, tool_call_spec

    if example.tools:
        return tool_call_spec(list(example.tools), "auto").structure
    if example.kind == "json":
        return StructuredOutputsParams(json=example.schema())
    if example.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    return None


@torch.no_grad()
def decode_chat(model: torch.nn.Module, tokenizer: Any, examples: Sequence[Any], strategy: Strategy, *,
                enforce: bool = True, batch_size: int = 16, seed: int = 0) -> list[tuple[str, bool]]:
    """Each example's answer under `strategy`: (its text up to the end token, whether it ended:
    an EOS/EOT before the end of its `CHAT_GEN_LENGTHS` positions, finish reason `stop`).
    `enforce`: held to `structure_of(example)` as the server holds it (rows sharing a structure
    share a batch). Greedy strategies give the same answers in any batch."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, e in enumerate(examples):
        structure = structure_of(e) if enforce else None
        groups.setdefault((CHAT_GEN_LENGTHS[e.kind], None if structure is None else structure.key), []).append(i)
    out: list[tuple[str, bool]] = [("", False)] * len(examples)
    generator = torch.Generator().manual_seed(seed)
    for (gen_length, key), rows in groups.items():
        structure = None if key is None else structure_of(examples[rows[0]])
        for start in range(0, len(rows), batch_size):
            chunk = rows[start:start + batch_size]
            ids, mask = chat_prompt_batch([examples[i] for i in chunk], tokenizer)
            attention_mask = mask if bool((mask == 0).any()) else None
            options = {**strategy.options, "structured_outputs": structure, "tokenizer": tokenizer}
            if strategy.ar:
                answer = ar_generate(model, ids, attention_mask=attention_mask, max_new_tokens=gen_length,
                                     generator=generator, **options)
            else:
                answer = generate(model, ids, attention_mask, steps=strategy.steps or gen_length,
                                  gen_length=gen_length, block_length=min(strategy.block_length or gen_length,
                                                                          gen_length), generator=generator, **options)
            for i, row in zip(chunk, answer[:, ids.shape[1]:].tolist()):
                ended = any(t in (charset.EOS_ID, charset.EOT_ID) for t in row)
                out[i] = (charset.decode_answer(row), ended)
    return out


def _json_valid(example: Any, text: str, tokenizer: Any) -> bool:
    """Whether `text` is JSON the example's schema accepts (whitespace allowed), by the same
    matcher the enforcement uses."""
    from remask.structured import StructuredOutputsParams, compile_structure

    schema = example.schema()
    params = StructuredOutputsParams(json=schema, disable_any_whitespace=False)
    try:
        tokens = charset.encode_text(text)
    except ValueError:
        return False
    compiled = compile_structure(params, tokenizer, charset.VOCAB_SIZE, (charset.MASK_ID,))
    return compiled.matcher([charset.EOS_ID]).valid(tokens + [charset.EOS_ID])


def _rate(flags: Sequence[bool]) -> float:
    return round(sum(flags) / max(1, len(flags)), 4)


def chat_metrics(model: torch.nn.Module, tokenizer: Any, n: int, strategy: Strategy,
                 seed: int | None = None) -> dict[str, Any]:
    """One strategy's figures on `n` held-out examples per format (seed `EVAL_SEED`):

    * `plain`: exact-match accuracy (and per task);
    * `json_enforced` / `json_unenforced` (json schema and json_object examples together):
      `valid_stop` (ended with the schema satisfied), `correct_stop` (and the right values);
    * `tool_auto` (tool_call and tool_text examples, the `auto` grammar enforced):
      `right_tool_or_text` (the right tool(s) when one fits, text when none does), `exact`
      (the right calls with the right arguments, or the right text answer);
    * `tool_answer`: the final text answer after the tool results is correct."""
    from remask.zoo.formats import examples as make
    from remask.zoo.tasks import EVAL_SEED

    seed = EVAL_SEED if seed is None else seed
    sets = {kind: make(n, seed, kinds=(kind,)) for kind in ("plain", "json", "json_object", "tool_call",
                                                             "tool_text", "tool_answer")}
    report: dict[str, Any] = {"strategy": strategy.name, "n_per_format": n}
    plain = sets["plain"]
    answers = decode_chat(model, tokenizer, plain, strategy)
    ok = [e.is_correct(text) for e, (text, _) in zip(plain, answers)]
    per_task: dict[str, list[bool]] = {}
    for e, flag in zip(plain, ok):
        per_task.setdefault(e.task, []).append(flag)
    report["plain"] = {"accuracy": _rate(ok), "per_task": {t: _rate(v) for t, v in per_task.items()}}
    json_set = sets["json"] + sets["json_object"]
    for enforce in (True, False):
        answers = decode_chat(model, tokenizer, json_set, strategy, enforce=enforce)
        valid = [ended and _json_valid(e, text, tokenizer) for e, (text, ended) in zip(json_set, answers)]
        correct = [v and e.is_correct(text) for v, e, (text, _) in zip(valid, json_set, answers)]
        report["json_enforced" if enforce else "json_unenforced"] = {"valid_stop": _rate(valid),
                                                                     "correct_stop": _rate(correct)}
    auto_set = sets["tool_call"] + sets["tool_text"]
    answers = decode_chat(model, tokenizer, auto_set, strategy)
    report["tool_auto"] = {
        "right_tool_or_text": _rate([ended and e.right_tool(text) for e, (text, ended) in zip(auto_set, answers)]),
        "exact": _rate([ended and e.is_correct(text) for e, (text, ended) in zip(auto_set, answers)]),
        "calls_when_needed": _rate([ended and e.right_tool(text) for e, (text, ended) in zip(auto_set, answers)
                                    if e.needs_tool]),
        "text_when_not": _rate([ended and e.right_tool(text) for e, (text, ended) in zip(auto_set, answers)
                                if not e.needs_tool])}
    answers = decode_chat(model, tokenizer, sets["tool_answer"], strategy)
    report["tool_answer"] = {"accuracy": _rate([ended and e.is_correct(text) for e, (text, ended)
                                                in zip(sets["tool_answer"], answers)])}
    return report


@torch.no_grad()
def tool_lean(model: torch.nn.Module, tokenizer: Any, n: int) -> dict[str, list[float]]:
    """A diffusion chat model's first decision when tools are offered, before any decoding order
    acts. For `n` held-out `tool_call` conversations (a tool fits) and `n` `tool_text` ones (none
    fits), it takes the probability of a call's first character at the answer's first position,
    with all 128 answer positions masked. Above 0.5 the model leans to a call. Returns the
    probabilities per kind.

        >>> from remask.zoo import load
        >>> lean = tool_lean(*load("tiny-llada-chat"), 8)
        >>> sum(lean["tool_call"]) > sum(lean["tool_text"])
        True
    """
    from remask.zoo.formats import CALL_TAG, examples as make
    from remask.zoo.tasks import EVAL_SEED

    mask_id, call_start = get_spec(model).mask_id, charset.CHAR_TO_ID[CALL_TAG[0]]
    lean = {}
    for kind in ("tool_call", "tool_text"):
        ids, mask = chat_prompt_batch(make(n, EVAL_SEED, kinds=(kind,)), tokenizer)
        answer = torch.full((n, CHAT_GEN_LENGTHS[kind]), mask_id)
        logits = model(torch.cat([ids, answer], 1), attention_mask=torch.cat([mask, torch.ones_like(answer)], 1)).logits
        lean[kind] = logits[:, ids.shape[1]].float().softmax(-1)[:, call_start].tolist()
    return lean


def chat_report(folder: str, n: int) -> dict[str, Any]:
    """`chat_metrics` of the chat model in `folder` under each of `chat_strategies`."""
    from remask.zoo import load

    model, tokenizer = load(folder)
    ar = get_spec(model).kind == "ar"
    return {"strategies": [chat_metrics(model, tokenizer, n, strategy) for strategy in chat_strategies(ar)]}
