"""`remask.LLM`: offline batched generation over `LLMEngine`, in the shape vLLM users know.

    >>> import remask
    >>> llm = remask.LLM("tiny-llada")
    >>> params = remask.SamplingParams(max_tokens=16, steps=16, block_length=8, seed=0)
    >>> [out.outputs[0].text for out in llm.generate(["sort 52814", "reverse abcd"], params, use_tqdm=False,
    ...                                              chat=True)]
    ['12458', 'dcba']
"""
from __future__ import annotations

import time
from typing import Any, Sequence as Seq

import torch

from remask.diffusion.parts.checks import check_bool

from .llm_engine import LLMEngine
from .sampling_params import SamplingParams
from .sequence import RequestOutput

# text, token ids, or vLLM's TextPrompt {"prompt": text} / TokensPrompt {"prompt_token_ids": ids}
Prompt = str | Seq[int] | dict[str, Any]
Message = dict[str, str]


class LLM:
    """An engine over one model: a shipped name (`"tiny-llada"`, `"tiny-ar"`), a checkpoint folder,
    or a loaded model (then pass its `tokenizer` for text prompts). `dtype` / `device` (default
    float32 on CPU) and `quantization` ("int8": torchao weight-only, or a transformers quantization
    config) apply when loading; the other arguments are `LLMEngine`'s."""

    def __init__(self, model: str | torch.nn.Module, tokenizer: Any = None, *, dtype: torch.dtype | None = None,
                 device: str | torch.device | None = None, max_num_seqs: int = 64,
                 max_num_batched_tokens: int = 16384, kv_cache_pages: int | None = None,
                 kv_cache_memory_fraction: float | None = None, page_size: int = 16,
                 enable_prefix_caching: bool = True, batch_invariant: bool = True, seed: int = 0,
                 quantization: Any = None, max_request_bytes: int | None = None, cuda_graphs: bool = False,
                 varlen_attention: bool = False) -> None:
        if not isinstance(model, torch.nn.Module):
            from remask.zoo import load

            model, loaded_tokenizer = load(model, dtype=dtype or torch.float32, device=device or "cpu",
                                           quantization=quantization)
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        elif dtype is not None or device is not None or quantization is not None:
            raise ValueError("dtype / device / quantization apply when LLM loads the model; prepare a loaded "
                             "model yourself")
        self.tokenizer = tokenizer
        self.engine = LLMEngine(model, tokenizer, max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens, kv_cache_pages=kv_cache_pages,
                                kv_cache_memory_fraction=kv_cache_memory_fraction, page_size=page_size,
                                enable_prefix_caching=enable_prefix_caching, batch_invariant=batch_invariant,
                                seed=seed, max_request_bytes=max_request_bytes, cuda_graphs=cuda_graphs,
                                varlen_attention=varlen_attention)
        self._counter = 0

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
                 chat: bool = False) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in input order. `prompts`: one prompt or a list (mixed
        forms allowed) of strings, token ids, `{"prompt": text}` or `{"prompt_token_ids": ids}`;
        `sampling_params`: one for all or one per prompt. `chat=True` wraps each text prompt as
        one user message in the tokenizer's chat template (as `LLM.chat` does)."""
        # a dict is one prompt, never iterated as a list of keys
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, (list, tuple)) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        check_bool("use_tqdm", use_tqdm)
        prompts = [self._chat_prompt(p) for p in prompts] if chat else list(prompts)
        return self._run(prompts, sampling_params, use_tqdm)

    def _chat_prompt(self, prompt: Prompt) -> Prompt:
        """A text prompt as the ids of one user message in the chat template (anything else as it is,
        for the engine to check)."""
        if isinstance(prompt, dict) and set(prompt) == {"prompt"} and isinstance(prompt["prompt"], str):
            prompt = prompt["prompt"]
        return self.chat_ids([{"role": "user", "content": prompt}]) if isinstance(prompt, str) else prompt

    def chat(self, messages: Seq[Message] | Seq[Seq[Message]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = True, tools: list[dict[str, Any]] | None = None,
             response_format: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Replies to conversations (one, or a list of them) through the tokenizer's chat template,
        generation prompt appended, with `tools` / `response_format` shown to it (`chat_ids`). Prompts go
        to `generate`."""
        if isinstance(messages, (str, dict)):
            raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts or a list of such lists, got a "
                             f"{type(messages).__name__}; prompts go to LLM.generate")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        return self._run([self.chat_ids(c, tools, response_format) for c in conversations], sampling_params, use_tqdm)

    def chat_ids(self, messages: Seq[Message], tools: list[dict[str, Any]] | None = None,
                 response_format: dict[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation through the tokenizer's chat template, generation prompt
        appended; `tools` (OpenAI's function tools) and `response_format` (the JSON format asked for)
        go to the template as its variables of those names, for a template that reads them (the zoo's
        chat models show both to the model). An assistant message's `tool_calls` and `tool` messages
        are rendered by the template when it reads them, else in remask's compact fallback
        (`remask.structured.messages_for_template`), never dropped."""
        from remask.structured import messages_for_template

        if self.tokenizer is None or getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("chat needs a tokenizer with a chat template")
        extra = {name: value for name, value in (("tools", tools), ("response_format", response_format))
                 if value is not None}
        out = self.tokenizer.apply_chat_template(messages_for_template(self.tokenizer, list(messages)),
                                                 add_generation_prompt=True, tokenize=True, **extra)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def _run(self, prompts: list[Prompt], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params has {len(params)} entries for {len(prompts)} prompts")
        # only finished outputs are returned: the engine builds none before (vLLM's LLM does the same)
        final_only = {id(p): p.replace(output_kind="final_only") if isinstance(p, SamplingParams) else p
                      for p in params}
        params = [final_only[id(p)] for p in params]
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                request_id = f"llm-{self._counter}"
                self._counter += 1
                self.engine.add_request(request_id, prompt, p)
                ids.append(request_id)
        except Exception:
            for request_id in ids:      # all or nothing: no half-submitted call left in the engine
                self.engine.abort_request(request_id)
            raise
        from tqdm.auto import tqdm

        finished: dict[str, RequestOutput] = {}
        start, tokens = time.perf_counter(), 0
        with tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm) as bar:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                        tokens += sum(len(o.all_token_ids) for o in out.outputs)
                        bar.update(1)
                        bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.0f} generated tok/s")
        return [finished[i] for i in ids]
