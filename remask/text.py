"""Text of generated answers: decoded up to the first end-of-sequence / end-of-turn token.

A diffusion model fills its whole generation window, and what follows the first EOS is not part
of the answer (LLaDA's SFT pads answers with EOS; a model may write characters after it).
`tokenizer.decode(ids, skip_special_tokens=True)` drops the EOS tokens but keeps what lies
between and after them (``"Hello, Hugo!<eos>oo<eos>"`` → ``"Hello, Hugo!oo"``); `answer_text`
stops at the first one.

    >>> import remask, torch
    >>> model, tokenizer = remask.load("tiny-llada")
    >>> ids = tokenizer("Hello, Hugo!")["input_ids"] + [tokenizer.eos_token_id] + tokenizer("oo")["input_ids"]
    >>> remask.answer_text(tokenizer, ids)
    'Hello, Hugo!'
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

# End-of-turn tokens of the chat formats remask's models use (LLaDA, Llama 3, Qwen/Dream, the tiny models).
END_OF_TURN_TOKENS = ("<|eot_id|>", "<|eot|>", "<|im_end|>", "<|endoftext|>")


def stop_token_ids(tokenizer: Any, model: torch.nn.Module | None = None) -> list[int]:
    """The ids that end an answer: the tokenizer's EOS, the end-of-turn tokens its vocabulary
    has, and (with `model`) the EOS/EOT ids the model's spec declares."""
    ids: list[int] = []
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids += [int(vocab[token]) for token in END_OF_TURN_TOKENS if token in vocab]
    if model is not None:
        from remask.models.spec import get_spec

        spec = get_spec(model)
        ids += [i for i in (spec.eos_id, spec.eot_id) if i is not None]
    return sorted(set(ids))


def answer_text(tokenizer: Any, ids: Sequence[int] | torch.Tensor, *, stop_ids: Sequence[int] | None = None,
                model: torch.nn.Module | None = None, skip_special_tokens: bool = True) -> str | list[str]:
    """Decode generated `ids` up to (not including) the first stop token.

    `ids`: one answer (a list or 1-D tensor) → str, or a batch (2-D tensor, list of lists) →
    list[str]. `stop_ids`: the stop tokens (default `stop_token_ids(tokenizer, model)`).
    """
    if torch.is_tensor(ids):
        if ids.dim() not in (1, 2):
            raise ValueError(f"ids must be a 1-D or 2-D tensor of token ids, got shape {tuple(ids.shape)}")
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        return [answer_text(tokenizer, row, stop_ids=stop_ids, model=model, skip_special_tokens=skip_special_tokens)
                for row in ids]
    stops = set(stop_token_ids(tokenizer, model) if stop_ids is None else stop_ids)
    end = next((i for i, token in enumerate(ids) if token in stops), len(ids))
    return tokenizer.decode(ids[:end], skip_special_tokens=skip_special_tokens)
