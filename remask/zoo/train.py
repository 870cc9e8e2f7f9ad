"""Train remask's tiny models on CPU: a LLaDA-format masked-diffusion model and a Llama AR model.

    python -m remask.zoo.train --model both --out remask/zoo/checkpoints
    python -m remask.zoo.train --model ar-chat --out remask/zoo/checkpoints            # the chat models:
    python -m remask.zoo.train --model llada-chat --procs 2 --out remask/zoo/checkpoints  # (from tiny-ar-chat)

Both models learn the problems of `remask.zoo.tasks` in the chat format of
`remask.zoo.charset`, answers padded with EOS to `--gen-length` positions.

The chat models `tiny-llada-chat` / `tiny-ar-chat` (same architectures, a context of 512) learn
the same tasks asked in every format of `remask.zoo.formats` (plain, JSON with a schema or
`json_object`, tool calls, answers from tool results, text when no offered tool fits), rendered
by `charset.CHAT_FORMATS_TEMPLATE`. Each step draws its answer length from `CHAT_LENGTHS` and
its examples from that length's kinds, so plain answers are also seen padded to 64 and 128
positions (what a server asks of the diffusion model when a client gives `max_tokens`).

* `tiny-llada`: LLaDA architecture, saved in the official LLaDA checkpoint format
  (`config.json` with the released keys, `model.safetensors` with the released parameter names,
  loadable by `AutoModel.from_pretrained` once `remask.models` is imported, or by the official remote
  code). Objective: LLaDA's SFT loss: per example a mask ratio t ~ U(eps, 1], each answer
  position (EOS padding included, prompt never) masked with probability t, cross-entropy on
  the masked positions weighted by 1/t, normalised by the answer length.
* `tiny-ar`: transformers `LlamaForCausalLM`, next-token loss on the answer and its first EOS.

Seeded and resumable: the batch and the masking noise of step s depend only on (seed, s), and a
training state (weights, optimiser, step) is written to `<out>/<name>/train_state.pt` every
`--save-every` steps; `--resume` continues from it and gives the same weights as an
uninterrupted run. At the end each model is evaluated on the held-out set (one token per step
for the diffusion model, greedy for the AR model) and the figures are written to
`<out>/<name>/metrics.json`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

from remask.zoo import charset, tasks

GEN_LENGTH = 16

LLADA_SIZE = dict(d_model=128, n_heads=4, n_kv_heads=4, n_layers=4, mlp_hidden_size=384)
AR_SIZE = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=3,
               intermediate_size=384)
CHOICES = {"llada": ["tiny-llada"], "ar": ["tiny-ar"], "both": ["tiny-llada", "tiny-ar"],
           "llada-chat": ["tiny-llada-chat"], "ar-chat": ["tiny-ar-chat"], "chat": ["tiny-llada-chat", "tiny-ar-chat"]}
# The chat models: the first models' shapes (measured: see docs/models.md), a context of 512;
# tiny-llada-chat starts from tiny-ar-chat's weights (`CHAT_BASE`), its 3 layers and a fourth that starts as the
# identity (`load_grown`)
LLADA_CHAT_SIZE = dict(LLADA_SIZE)
AR_CHAT_SIZE = dict(AR_SIZE)
# Chat training: a step's answer length (positions, EOS padding included) → share of steps, and
# the kinds of `remask.zoo.formats` a step of that length draws (every answer fits with one EOS).
CHAT_LENGTHS = {16: 0.25, 64: 0.3, 128: 0.45}
CHAT_KINDS = {16: {"plain": 1.0},
              64: {"plain": 0.2, "json": 0.6, "json_object": 0.2},
              128: {"plain": 0.05, "json": 0.1, "tool_call": 0.25, "tool_answer": 0.45, "tool_text": 0.15}}
# tiny-ar-chat's 128-position steps: more answers after tool results, no plain or JSON (plain and JSON
# are learnt in the shorter steps; the step cost is that of the longest prompt anyway)
AR_CHAT_KINDS = {**CHAT_KINDS, 128: {"tool_call": 0.3, "tool_answer": 0.55, "tool_text": 0.15}}
# Both chat models: half of the tool conversations with two problems (the held-out sets: `formats.PARALLEL`),
# since most misses were two results, one copied wrong (tiny-ar-chat's second run: 10 of 11; tiny-llada-chat's
# fifth run: 7 of the first 16 answers, all with two results)
CHAT_PARALLEL = 0.5
# tiny-llada-chat: the share of its answers after tool results that have two (every miss of the ninth run had two)
LLADA_CHAT_PARALLEL_AFTER_TOOL = 0.8
# tiny-llada-chat: per kind, the share of its examples trained with the whole answer masked (t = 1), the state
# decoding starts from. With t ~ U(0, 1] a tools conversation reached it about once in 20 steps, and the call-or-text
# decision from the prompt alone stayed at 70-74% over three mixtures (`evaluate.tool_lean`); with these rows (about
# 1.7 a step) it reached 99% and `auto` 96-100% (docs/models.md, ninth run)
CHAT_WHOLE_MASKED = {"tool_call": 0.3, "tool_text": 0.3}
CHAT_GEN_LENGTH = max(CHAT_LENGTHS)
CHAT_BATCH_SIZE = 64
LLADA_CHAT_BATCH_SIZE = 32   # at equal compute, twice the steps of batch 64 learnt more (docs/models.md, fifth run)
CHAT_CHUNKS = 4           # a chat batch is forwarded in 4 groups of similar prompt length (~30% less padding)
# Sized to 1 hour per model (docs/models.md, "The chat models": tiny-ar-chat 0.99 CPU s per step on one core;
# tiny-llada-chat, 4 layers, 0.32-0.40 s per step on both cores with `--procs 2` (an AVX-512 EPYC), after
# tiny-ar-chat; plus about 6 / 5 minutes of final evaluation).
LLADA_CHAT_STEPS = 10000
AR_CHAT_STEPS = 3000
CHAT_EVAL_PROBLEMS = 56   # per format (8 per task where every task can be asked)
# A chat model starts from trained weights of the same shapes (rotary positions, so the longer
# context needs no new parameters): the hour goes to the formats, not to relearning the tasks
# (from scratch, tiny-llada-chat had 32% plain accuracy after its hour). tiny-llada-chat starts
# from tiny-ar-chat, which already writes the formats (`llama_to_llada`: the AR model adapted to
# masked diffusion, as Dream and DiffuLLaMA start from AR models); from tiny-llada it learnt their
# outline but not their content (docs/models.md). `--from-scratch` skips it.
CHAT_BASE = {"tiny-llada-chat": "tiny-ar-chat", "tiny-ar-chat": "tiny-ar"}
# a Llama layer's weights → the LLaDA block's (the released LLaDA checkpoint's names)
LLAMA_TO_LLADA = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ff_norm", "self_attn.q_proj": "q_proj",
                  "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj", "self_attn.o_proj": "attn_out",
                  "mlp.gate_proj": "ff_proj", "mlp.up_proj": "up_proj", "mlp.down_proj": "ff_out"}
CHAT_LR = 1e-3            # peak lr of the chat models' fine-tuning (first models: 2e-3 from scratch)


def is_chat(name: str) -> bool:
    return name.endswith("-chat")


def is_llada(name: str) -> bool:
    return name.startswith("tiny-llada")


def llada_config(context: int = 128, **size: Any) -> dict[str, Any]:
    """The official-format config.json of tiny-llada (LLaDA-8B-Instruct's keys, tiny shapes, char vocab)."""
    from remask.models.tiny import LLADA_DEFAULTS

    return {**LLADA_DEFAULTS, **LLADA_SIZE, **size,
            "vocab_size": charset.VOCAB_SIZE, "embedding_size": charset.VOCAB_SIZE,
            "mask_token_id": charset.MASK_ID, "eos_token_id": charset.EOS_ID, "pad_token_id": charset.PAD_ID,
            "eot_token_id": charset.EOT_ID, "bos_token_id": charset.BOS_ID, "max_sequence_length": context,
            "rope_theta": 10000.0, "precision": "fp32", "torch_dtype": "float32"}


def ar_config(context: int = 128, **size: Any):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=charset.VOCAB_SIZE, **{**AR_SIZE, **size}, max_position_embeddings=context,
                       rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=charset.BOS_ID,
                       eos_token_id=charset.EOS_ID, pad_token_id=charset.PAD_ID, mask_token_id=charset.MASK_ID)


def build_model(name: str, seed: int, width: int | None = None, layers: int | None = None) -> tuple[torch.nn.Module, Any]:
    """A freshly initialised model; `width`/`layers` shrink it (smoke tests), default: the shipped sizes."""
    torch.manual_seed(seed)
    context = charset.CHAT_CONTEXT if is_chat(name) else 128
    if is_llada(name):
        from remask.models import LLaDAConfig, LLaDAModelLM

        size = dict(LLADA_CHAT_SIZE) if is_chat(name) else {}
        size.update({} if width is None else dict(d_model=width, n_heads=2, n_kv_heads=2, mlp_hidden_size=2 * width))
        size.update({} if layers is None else {"n_layers": layers})
        config = llada_config(context, **size)
        return LLaDAModelLM(LLaDAConfig(**config)), config
    from transformers import LlamaForCausalLM

    size = dict(AR_CHAT_SIZE) if is_chat(name) else {}
    size.update({} if width is None else dict(hidden_size=width, num_attention_heads=2, num_key_value_heads=2,
                                              intermediate_size=2 * width))
    size.update({} if layers is None else {"num_hidden_layers": layers})
    config = ar_config(context, **size)
    return LlamaForCausalLM(config), config


def batch_at(step: int, seed: int, batch_size: int, gen_length: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Training batch of step `step`: left-padded `[B, P + gen_length]` ids, the padding mask and P."""
    from remask.zoo.evaluate import prompt_batch

    rng = random.Random(seed * 1_000_003 + step)
    problems = [tasks.draw(rng) for _ in range(batch_size)]
    prompt_ids, prompt_mask = prompt_batch(problems)
    answers = torch.tensor([charset.encode_answer(p.target, gen_length) for p in problems], dtype=torch.long)
    ids = torch.cat([prompt_ids, answers], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(answers)], dim=1)
    return ids, mask, prompt_ids.shape[1]


def chat_batch_at(step: int, seed: int, batch_size: int, ar: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]:
    """A chat model's training batch of step `step` (`batch_at`'s layout, then each row's share of whole-answer
    masking, `CHAT_WHOLE_MASKED` of its kind; the AR loss reads none): its answer length drawn from `CHAT_LENGTHS`, its examples from that
    length's `CHAT_KINDS`, every answer EOS-padded to that length, `CHAT_PARALLEL` of the tool conversations with
    two problems (`ar`: `AR_CHAT_KINDS`, answers padded to the longest one's length + 1, the AR loss stops at the
    first EOS)."""
    from remask.zoo import formats
    from remask.zoo.evaluate import chat_prompt_batch

    rng = random.Random(seed * 1_000_003 + step)
    gen_length = rng.choices(tuple(CHAT_LENGTHS), weights=tuple(CHAT_LENGTHS.values()))[0]
    kinds = (AR_CHAT_KINDS if ar else CHAT_KINDS)[gen_length]
    parallel = {"tool_answer": CHAT_PARALLEL if ar else LLADA_CHAT_PARALLEL_AFTER_TOOL}
    examples = []
    for _ in range(batch_size):   # the kind and its example drawn in turn from one stream
        kind = rng.choices(tuple(kinds), weights=tuple(kinds.values()))[0]
        examples.append(formats.example(rng, kind, parallel=parallel.get(kind, CHAT_PARALLEL)))
    if ar:
        gen_length = max(len(e.target) for e in examples) + 1
    prompt_ids, prompt_mask = chat_prompt_batch(examples)
    answers = torch.tensor([charset.encode_answer(e.target, gen_length) for e in examples], dtype=torch.long)
    ids = torch.cat([prompt_ids, answers], dim=1)
    mask = torch.cat([prompt_mask, torch.ones_like(answers)], dim=1)
    return ids, mask, prompt_ids.shape[1], torch.tensor([CHAT_WHOLE_MASKED.get(e.kind, 0.0) for e in examples])


def row_chunks(mask: torch.Tensor, P: int, chunks: int) -> list[tuple[Any, int]]:
    """The batch's rows in `chunks` groups of similar prompt length, each with the first column
    it needs (the left padding every row of the group has is dropped): `[(rows, start)]`. One
    chunk: every row from column 0 (the computation of an unchunked batch, bit for bit)."""
    if chunks <= 1:
        return [(slice(None), 0)]
    prompt_length = mask[:, :P].sum(1)
    order = torch.argsort(prompt_length, stable=True)
    return [(rows, P - int(prompt_length[rows].max())) for rows in order.chunk(chunks) if len(rows)]


def llada_sft_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, P: int,
                   gen: torch.Generator, eps: float = 1e-3, chunks: int = 1, stratified: bool = False,
                   share: tuple[int, int] = (0, 1), whole: torch.Tensor | None = None) -> torch.Tensor:
    """LLaDA's SFT objective: mask answer positions with probability t ~ U(eps, 1], CE / t.
    `chunks`: forward the rows in groups of similar prompt length (`row_chunks`; less padding,
    the same noise and normalisation). `stratified`: the batch's t spread evenly over (0, 1] (one
    offset drawn, row i at (i + u) / B, rows shuffled): the same expected loss, less variance
    from the 1/t weight (the chat models). `share` (rank, processes): this process's part of the chunks
    (every `processes`-th from `rank`) under the whole batch's noise and normalisation: the ranks' losses
    add up to the batch's (`--procs`). `whole` `[B]`: each row's probability of t = 1, every answer position
    masked (drawn after the other noise, which stays as without it)."""
    B, L = ids.shape
    if stratified:
        u = (torch.arange(B) + torch.rand(1, generator=gen)) / B
        t = (1 - eps) * u[torch.randperm(B, generator=gen)] + eps
    else:
        t = (1 - eps) * torch.rand(B, generator=gen) + eps
    masked = torch.rand((B, L), generator=gen) < t[:, None]
    if whole is not None:
        chosen = torch.rand(B, generator=gen) < whole
        masked[chosen], t = True, torch.where(chosen, 1.0, t)
    masked[:, :P] = False
    noisy = torch.where(masked, torch.full_like(ids, charset.MASK_ID), ids)
    weight = t[:, None].expand(B, L)
    total = torch.zeros(())
    for rows, start in row_chunks(mask, P, chunks)[share[0]::share[1]]:
        m = masked[rows, start:]
        logits = model(noisy[rows, start:], attention_mask=mask[rows, start:]).logits
        token_loss = F.cross_entropy(logits[m], ids[rows, start:][m], reduction="none") / weight[rows, start:][m]
        total = total + token_loss.sum()
    answer_length = L - P
    return total / (B * answer_length)


def ar_loss(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, P: int, chunks: int = 1,
            share: tuple[int, int] = (0, 1)) -> torch.Tensor:
    """Next-token cross-entropy on the answer characters and the first EOS (not the EOS padding);
    `chunks` and `share` as in `llada_sft_loss`."""
    labels = ids.clone()
    labels[:, :P] = -100
    # counted in the answer only: a chat prompt holds the EOS of earlier assistant turns
    after_first_eos = (ids[:, P:] == charset.EOS_ID).long().cumsum(-1) > 1
    labels[:, P:][after_first_eos] = -100
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    if chunks <= 1 and share[1] == 1:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids).logits
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                               ignore_index=-100)
    total = torch.zeros(())
    for rows, start in row_chunks(mask, P, chunks)[share[0]::share[1]]:
        logits = model(input_ids=ids[rows, start:], attention_mask=mask[rows, start:],
                       position_ids=position_ids[rows, start:]).logits
        total = total + F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                        labels[rows, start + 1:].reshape(-1), ignore_index=-100, reduction="sum")
    return total / (labels[:, 1:] != -100).sum()


def llama_to_llada(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A `LlamaForCausalLM` state dict as `LLaDAModelLM`'s of the same sizes: the layers renamed (`LLAMA_TO_LLADA`),
    the output layer the LM head (the tied embedding when there is none)."""
    out = {"model.transformer.wte.weight": state["model.embed_tokens.weight"],
           "model.transformer.ln_f.weight": state["model.norm.weight"],
           "model.transformer.ff_out.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"])}
    for key, value in state.items():
        if key.startswith("model.layers."):
            layer, name = key[len("model.layers."):].removesuffix(".weight").split(".", 1)
            out[f"model.transformer.blocks.{layer}.{LLAMA_TO_LLADA[name]}.weight"] = value
    return {key: value.clone() for key, value in out.items()}


def load_grown(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load `state` into `model`, which may have more layers: each layer the state lacks keeps its seeded
    initialisation with its attention and MLP output projections zero, so it starts as the identity (the residual
    stream passes it unchanged) and the grown model computes what the state's did."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    new = [key for key in missing if ".blocks." in key]
    if unexpected or len(new) != len(missing):
        raise ValueError(f"the start weights do not fit the model: missing {sorted(missing)}, unexpected "
                         f"{sorted(unexpected)}")
    with torch.no_grad():
        for key in new:
            if key.endswith((".attn_out.weight", ".ff_out.weight")):
                model.get_parameter(key).zero_()


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def save_checkpoint(name: str, model: torch.nn.Module, config: Any, folder: str) -> None:
    """Write the model folder: weights + config in its release format, plus the tokenizer."""
    os.makedirs(folder, exist_ok=True)
    if is_llada(name):
        from remask.models.tiny import write_llada_checkpoint

        write_llada_checkpoint(folder, config, {k: v.detach().clone() for k, v in model.state_dict().items()})
    else:
        model.save_pretrained(folder)
    charset.build_tokenizer(formats=is_chat(name)).save_pretrained(folder)


def train(name: str, out: str, steps: int, batch_size: int, lr: float, warmup: int, seed: int,
          save_every: int, resume: bool, log_every: int, gen_length: int, stop_after: int | None = None,
          width: int | None = None, layers: int | None = None, init_from: str | None = None,
          share: tuple[int, int] = (0, 1)) -> dict[str, Any] | None:
    """Train one model; returns its record, or None when `stop_after` interrupted it (state saved) or on a
    rank other than 0. `init_from`: a checkpoint folder whose weights the model starts from. `share` (rank,
    processes): data parallel over a started process group (`--procs`); every rank draws the whole batch, computes
    its part of the loss and sums the gradients with the others, so the ranks' weights stay equal; rank 0 writes."""
    rank, procs = share
    folder = os.path.join(out, name)
    state_path = os.path.join(folder, "train_state.pt")
    model, config = build_model(name, seed, width, layers)
    if init_from is not None:
        from remask.zoo import load

        base = load(init_from)[0].state_dict()
        load_grown(model, llama_to_llada(base) if is_llada(name) and "model.embed_tokens.weight" in base else base)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.98))
    start, log = 0, []
    say = print if rank == 0 else (lambda *_, **__: None)
    if resume and os.path.exists(state_path):
        state = torch.load(state_path, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start, log = state["step"], state["log"]
        say(f"[{name}] resumed at step {start}", flush=True)
    os.makedirs(folder, exist_ok=True)
    n_params = sum(p.numel() for p in model.parameters())
    say(f"[{name}] {n_params / 1e6:.2f}M parameters, steps {start}..{steps}, batch {batch_size}, {procs} process(es)",
        flush=True)
    model.train()
    t0, running = time.time(), 0.0
    end = steps if stop_after is None else min(steps, start + stop_after)
    for step in range(start, end):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        if is_chat(name):
            ids, mask, P, whole = chat_batch_at(step, seed, batch_size, ar=not is_llada(name))
        else:
            (ids, mask, P), whole = batch_at(step, seed, batch_size, gen_length), None
        chunks = max(CHAT_CHUNKS if is_chat(name) else 1, procs)   # each rank at least one chunk
        if is_llada(name):
            noise = torch.Generator().manual_seed(seed * 7_919 + step)
            loss = llada_sft_loss(model, ids, mask, P, noise, chunks=chunks, stratified=is_chat(name), share=share,
                                  whole=whole)
        else:
            loss = ar_loss(model, ids, mask, P, chunks=chunks, share=share)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if procs > 1:
            loss = _sum_over_ranks(model, loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running += float(loss.detach())
        if (step + 1) % log_every == 0:
            log.append({"step": step + 1, "loss": running / log_every, "seconds": round(time.time() - t0, 1)})
            say(f"[{name}] step {step + 1}/{steps} loss {running / log_every:.4f} "
                  f"lr {optimizer.param_groups[0]['lr']:.2e} {time.time() - t0:.0f}s", flush=True)
            running = 0.0
        if rank == 0 and ((step + 1) % save_every == 0 or step + 1 == end):
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1, "log": log},
                       state_path)
    if rank != 0:
        return None
    if end < steps:
        print(f"[{name}] stopped at step {end} (--stop-after); continue with --resume", flush=True)
        return None
    model.eval()
    if is_llada(name):
        # Beyond its training answers' length the model is confidently wrong; the samplers warn there.
        config = {**config, "trained_gen_length": CHAT_GEN_LENGTH if is_chat(name) else gen_length}
    save_checkpoint(name, model, config, folder)
    return {"parameters": n_params, "steps": steps, "batch_size": batch_size, "processes": procs, "lr": lr,
            "seed": seed, "init_from": None if init_from is None else os.path.basename(init_from),
            "train_seconds_this_run": round(time.time() - t0, 1), "log": log}


def _sum_over_ranks(model: torch.nn.Module, loss: torch.Tensor) -> torch.Tensor:
    """Every parameter's gradient and the loss summed over the process group's ranks (one all-reduce of a flat
    buffer, the same sum on every rank); returns the summed loss."""
    import torch.distributed as dist

    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads] + [loss.detach().reshape(1)])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return flat[-1]


def _rank_main(rank: int, argv: list[str], procs: int, store: str) -> None:
    """One process of `--procs`: joins the group (gloo over a file store on this machine), then trains its share."""
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # the group talks over loopback only
    dist.init_process_group("gloo", store=dist.FileStore(store, procs), rank=rank, world_size=procs)
    try:
        code = main(argv, share=(rank, procs))
    finally:
        dist.destroy_process_group()
    if code:
        raise SystemExit(code)


def main(argv: list[str] | None = None, share: tuple[int, int] = (0, 1)) -> int:
    parser = argparse.ArgumentParser(prog="python -m remask.zoo.train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=tuple(CHOICES), default="both",
                        help="llada / ar / both: tiny-llada, tiny-ar; llada-chat / ar-chat / chat: tiny-llada-chat, "
                             "tiny-ar-chat")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "checkpoints"),
                        help="parent folder; each model goes to <out>/<name> (tiny-llada, tiny-ar-chat, ...)")
    parser.add_argument("--llada-steps", type=int, default=5000)
    parser.add_argument("--ar-steps", type=int, default=1500)
    parser.add_argument("--llada-chat-steps", type=int, default=LLADA_CHAT_STEPS)
    parser.add_argument("--ar-chat-steps", type=int, default=AR_CHAT_STEPS)
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"examples per step (default 128; tiny-ar-chat {CHAT_BATCH_SIZE}, tiny-llada-chat "
                             f"{LLADA_CHAT_BATCH_SIZE})")
    parser.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default 2e-3; chat models {CHAT_LR})")
    parser.add_argument("--init-from", default=os.path.join(os.path.dirname(__file__), "checkpoints"),
                        help="chat models: the parent folder of the models they start from (CHAT_BASE; "
                             "default: the shipped ones)")
    parser.add_argument("--from-scratch", action="store_true", help="chat models: start from random weights")
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=tasks.TRAIN_SEED)
    parser.add_argument("--gen-length", type=int, default=GEN_LENGTH)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per model; with --model both the two models train at the same time in "
                             "two processes (2 cores: one thread each), unless --sequential")
    parser.add_argument("--sequential", action="store_true", help="with --model both: one model after the other")
    parser.add_argument("--save-every", type=int, default=250)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--resume", action="store_true", help="continue from <out>/<name>/train_state.pt")
    parser.add_argument("--eval-problems", type=int, default=None,
                        help="held-out problems for the final evaluation (default 350; chat models: per format, "
                             f"default {CHAT_EVAL_PROBLEMS})")
    parser.add_argument("--stop-after", type=int, default=None,
                        help="train at most this many steps in this run, then save the state and exit (resume later)")
    parser.add_argument("--width", type=int, default=None, help="override the hidden size of both models (smoke tests)")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count of both models (smoke tests)")
    parser.add_argument("--keep-state", action="store_true", help="keep train_state.pt (default: delete it at the end)")
    parser.add_argument("--procs", type=int, default=1,
                        help="data parallel: train each model in this many processes (each --threads threads), every "
                             "one on its part of each batch (measured on 2 cores: as fast as --threads 2)")
    args = parser.parse_args(argv)
    if args.procs < 1:
        parser.error(f"--procs must be at least 1, got {args.procs}")
    torch.set_num_threads(args.threads)
    names = CHOICES[args.model]
    if len(names) > 1 and not args.sequential:
        return _train_both_in_parallel(list(sys.argv[1:] if argv is None else argv), names)
    if args.procs > 1 and share[1] == 1:
        return _data_parallel(list(sys.argv[1:] if argv is None else argv), args.procs)

    for name in names:
        steps = {"tiny-llada": args.llada_steps, "tiny-ar": args.ar_steps, "tiny-llada-chat": args.llada_chat_steps,
                 "tiny-ar-chat": args.ar_chat_steps}[name]
        batch_size = args.batch_size or {"tiny-llada-chat": LLADA_CHAT_BATCH_SIZE, "tiny-ar-chat": CHAT_BATCH_SIZE}.get(
            name, 128)
        lr = args.lr or (CHAT_LR if is_chat(name) else 2e-3)
        init_from = None if args.from_scratch or not is_chat(name) else os.path.join(args.init_from, CHAT_BASE[name])
        record = train(name, args.out, steps, batch_size, lr, args.warmup, args.seed, args.save_every,
                       args.resume, args.log_every, args.gen_length, args.stop_after, args.width, args.layers,
                       init_from, share)
        if record is None:
            continue
        from remask.zoo.evaluate import chat_report, held_out_report

        folder = os.path.join(args.out, name)
        if is_chat(name):
            record["held_out"] = chat_report(folder, args.eval_problems or CHAT_EVAL_PROBLEMS)
        else:
            record["held_out"] = held_out_report(folder, args.eval_problems or 350, args.gen_length)
        print(f"[{name}] held-out: {json.dumps(record['held_out'])}", flush=True)
        with open(os.path.join(folder, "metrics.json"), "w") as f:
            json.dump(record, f, indent=1)
        if not args.keep_state:
            state_path = os.path.join(folder, "train_state.pt")
            if os.path.exists(state_path):
                os.remove(state_path)
    return 0


def _data_parallel(argv: list[str], procs: int) -> int:
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        context = mp.start_processes(_rank_main, args=(argv, procs, os.path.join(folder, "store")), nprocs=procs,
                                     join=False, start_method="spawn")
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException as error:
            print(error, file=sys.stderr)
            return 1
        except mp.ProcessExitedException as error:
            return error.exit_code or 1
    return 0


def _train_both_in_parallel(argv: list[str], names: list[str]) -> int:
    import multiprocessing

    def without_model(args: list[str]) -> list[str]:
        out, skip = [], False
        for a in args:
            if skip:
                skip = False
            elif a == "--model":
                skip = True
            elif not a.startswith("--model="):
                out.append(a)
        return out

    base = without_model(argv)
    ctx = multiprocessing.get_context("spawn")
    which = {one[0]: choice for choice, one in CHOICES.items() if len(one) == 1}
    procs = [ctx.Process(target=main, args=(base + ["--model", which[name]],)) for name in names]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return max(p.exitcode or 0 for p in procs)


if __name__ == "__main__":
    sys.exit(main())
