"""lm-evaluation-harness adapter: the model `remask` (the `eval` extra: `pip install 'remask[eval]'`).

    remask eval --model remask --model_args pretrained=tiny-llada,steps=16,block_length=8 \
        --tasks remask_tiny --apply_chat_template

or, in Python, `lm_eval.simple_evaluate(model=RemaskLM(pretrained="tiny-llada", ...), tasks=[...],
task_manager=lm_eval.tasks.TaskManager(include_path=remask.integrations.lmeval.task_dir()))`.

* `generate_until` runs every request through one `remask.LLM` (batched, continuously scheduled,
  batch-invariant): the task's `until` strings become `stop`, `max_gen_toks` the generation
  length unless `--model_args` sets `max_tokens` (a diffusion model's length is a decoding setting,
  as in LLaDA's own adapter; the task's value is then reported as overridden, once).
* `loglikelihood`: exact token log-probabilities for an autoregressive model; for a diffusion
  model LLaDA's Monte-Carlo estimate (`eval_llada.py`): `mc_num` forwards in batches of
  `mc_batch_size`, each masking a random count k of the continuation (k spread evenly over the
  batch), the cross-entropy of the masked positions weighted by 1/(k/L); optional CFG
  (`cfg_scale`); `is_check_greedy` decodes the continuation one token per step (lowest index
  among equal confidences) to say whether it is the greedy answer. Draws come from a generator
  seeded by `seed` and the request, so the same command gives the same numbers;
  `reference_rng=True` draws from the global RNG in the reference's order instead, which replays a
  seeded run of LLaDA's `eval_llada.py` value for value (checked against its code).
* `loglikelihood_rolling`: autoregressive models (rolling windows); diffusion models have no
  defined rolling likelihood (as the reference) and say so.
* Every other `--model_args` key is a `remask.SamplingParams` field, validated when the model is
  built.
* Data parallel: under `torchrun --nproc_per_node N -m remask eval ...` (or `accelerate launch`)
  each process builds its own `LLM`, lm-eval shards the requests by rank and gathers the results:
  the numbers equal one process's (requests are seeded and batch-invariant).
"""
from __future__ import annotations

import importlib.resources
import os
import shutil
import tempfile
import warnings
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

import remask
from remask.engine import SamplingParams
from remask.models.parallel import full_logits

ADAPTER_ARGS = ("pretrained", "dtype", "device", "batch_size", "max_batch_size", "max_num_seqs", "seed", "mc_num",
                "mc_batch_size", "is_check_greedy", "trust_remote_code")
GEN_KWARGS = ("until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k")


def task_dir() -> str:
    """A folder holding the shipped `remask_tiny` task (YAML + JSONL of the zoo's held-out
    problems + its scoring), with the data path made absolute: pass it as lm-eval's
    `include_path`."""
    source = importlib.resources.files("remask.integrations") / "tasks" / "remask_tiny"
    folder = os.path.join(tempfile.gettempdir(), f"remask-lm-eval-tasks-{os.getuid() if hasattr(os, 'getuid') else 0}",
                          "remask_tiny")
    os.makedirs(folder, exist_ok=True)
    data = str(source / "test.jsonl")
    for name in ("utils.py",):
        shutil.copyfile(str(source / name), os.path.join(folder, name))
    yaml = (source / "remask_tiny.yaml").read_text(encoding="utf-8").replace("test.jsonl", data)
    with open(os.path.join(folder, "remask_tiny.yaml"), "w", encoding="utf-8") as f:
        f.write(yaml)
    return os.path.dirname(folder)


@register_model("remask")
class RemaskLM(LM):
    """`pretrained`: a shipped name or a checkpoint folder. The engine batches continuously and its
    tokens do not depend on the batch: `max_num_seqs` (default 64) sets how many sequences run at
    once, and lm-eval's `--batch_size` sets it when larger than 1 (lm-eval's default, 1, would
    decode one request at a time). `seed`: the seed of every request (generation and the
    Monte-Carlo draws)."""

    def __init__(self, pretrained: str = "tiny-llada", dtype: str | None = None, device: str | None = None,
                 batch_size: int | str = 64, max_batch_size: int | None = None, max_num_seqs: int | None = None,
                 seed: int = 0, mc_num: int = 128, mc_batch_size: int = 32, is_check_greedy: bool = False,
                 reference_rng: bool = False, trust_remote_code: bool = False, **sampling: Any) -> None:
        super().__init__()
        if isinstance(batch_size, str) and batch_size.startswith("auto"):
            batch_size = 1
        if max_num_seqs is None:
            max_num_seqs = int(batch_size) if int(batch_size) > 1 else 64
        if not isinstance(mc_num, int) or not isinstance(mc_batch_size, int) or mc_num < 1 or mc_batch_size < 1 \
                or mc_num % mc_batch_size:
            raise ValueError(f"mc_num ({mc_num!r}) must be a positive multiple of mc_batch_size ({mc_batch_size!r})")
        torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        if dtype is not None and not isinstance(torch_dtype, torch.dtype):
            raise ValueError(f"dtype must name a torch dtype (float32, bfloat16, ...), got {dtype!r}")
        if isinstance(device, str) and device.startswith("cuda") and not torch.cuda.is_available():
            # `remask eval` passes --device cpu where there is no CUDA and none was given, so this is a
            # cuda device asked for by name (or lm-eval's own default, cuda:0, through `lm_eval`)
            warnings.warn(f"device={device!r} but CUDA is not available here: running on cpu")
            device = "cpu"
        self.params = SamplingParams(**{"seed": seed, **sampling})   # every other key, validated now
        self.max_tokens_set = "max_tokens" in sampling
        self.llm = remask.LLM(pretrained, dtype=torch_dtype, device=device,
                              max_num_seqs=int(max_num_seqs), seed=seed)
        self.model, self.tokenizer = self.llm.engine.model, self.llm.tokenizer
        self.spec = self.llm.engine.spec
        self.name, self.seed = str(pretrained), seed
        self.mc_num, self.mc_batch_size, self.is_check_greedy = mc_num, mc_batch_size, bool(is_check_greedy)
        self.reference_rng = bool(reference_rng)
        self._warned_length = False
        # Data parallel under torchrun / accelerate launch: lm-eval shards the requests by rank and
        # gathers the results through the methods below (a gloo group on CPU).
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                dist.init_process_group("gloo" if self.llm.engine.device.type == "cpu" else "nccl")
            self._rank, self._world_size = dist.get_rank(), dist.get_world_size()
        else:
            self._rank, self._world_size = 0, 1

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world_size == 1:
            return tensor
        import torch.distributed as dist

        tensor = tensor.reshape(-1) if tensor.dim() == 0 else tensor     # lm-eval gathers scalar counts too
        parts = [torch.zeros_like(tensor) for _ in range(self._world_size)]
        dist.all_gather(parts, tensor)
        return torch.cat(parts)

    def gather_object(self, obj: Any, dst: int = 0) -> list | None:
        if self._world_size == 1:
            return [obj]
        import torch.distributed as dist

        parts: list | None = [None] * self._world_size if self._rank == dst else None
        dist.gather_object(obj, parts, dst=dst)
        return parts

    def barrier(self) -> None:
        if self._world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    # ---- chat ----

    @property
    def tokenizer_name(self) -> str:
        return self.name.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return getattr(self.tokenizer, "chat_template", None) or ""

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ---- generation ----

    def _gen_params(self, gen_kwargs: dict[str, Any]) -> SamplingParams:
        unknown = sorted(set(gen_kwargs) - set(GEN_KWARGS))
        if unknown:
            raise ValueError(f"generation kwargs not supported by remask: {unknown} (supported: {list(GEN_KWARGS)})")
        changes: dict[str, Any] = {}
        until = gen_kwargs.get("until")
        if until:
            changes["stop"] = [until] if isinstance(until, str) else [s for s in until if s]
        if "max_gen_toks" in gen_kwargs:
            if self.max_tokens_set:
                if not self._warned_length and gen_kwargs["max_gen_toks"] != self.params.max_tokens:
                    warnings.warn(f"the task asks for max_gen_toks={gen_kwargs['max_gen_toks']}; --model_args "
                                  f"max_tokens={self.params.max_tokens} is used (a decoding setting here)")
                    self._warned_length = True
            else:
                changes["max_tokens"] = int(gen_kwargs["max_gen_toks"])
        if gen_kwargs.get("do_sample") is False:
            changes["temperature"] = 0.0
        greedy = gen_kwargs.get("do_sample") is False
        for name in ("temperature", "top_p", "top_k"):
            if gen_kwargs.get(name) is not None and not (name == "temperature" and greedy):
                changes[name] = gen_kwargs[name]
        return self.params.replace(**changes) if changes else self.params

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        prompts = [req.args[0] for req in requests]
        params = [self._gen_params(dict(req.args[1])) for req in requests]
        outs = self.llm.generate(prompts, params, use_tqdm=not disable_tqdm)
        self.nfe_per_token = sum(o.outputs[0].nfe for o in outs) / max(1, sum(len(o.outputs[0].token_ids)
                                                                            for o in outs))
        return [o.outputs[0].text for o in outs]

    # ---- likelihoods ----

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Trailing spaces of the context belong to the continuation (lm-eval's rule).
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole, head = self._encode(context + continuation), self._encode(context)
        return head, whole[len(head):]

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        out = []
        for index, req in enumerate(requests):
            context, continuation = self._encode_pair(*req.args)
            if not continuation:
                raise ValueError(f"request {index}: the continuation {req.args[1]!r} encodes to no tokens")
            if self.spec.kind == "ar":
                out.append(self._ar_loglikelihood(context, continuation))
            else:
                generator = None if self.reference_rng else torch.Generator().manual_seed(
                    (self.seed * 1_000_003 + zlib.crc32(repr((context, continuation)).encode())) % 2**31)
                logprob = self._mc_loglikelihood(context, continuation, generator)
                out.append((logprob, self._greedy_suffix(context, continuation) if self.is_check_greedy else False))
        return out

    def _device_ids(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor([ids], dtype=torch.long, device=self.llm.engine.device)

    def _ar_loglikelihood(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        if not context:
            bos = getattr(self.tokenizer, "bos_token_id", None)
            context = [bos if bos is not None else continuation[0]]
        ids = self._device_ids(context + continuation)
        logits = self.model(input_ids=ids).logits[0, len(context) - 1:-1].float()
        logprobs = F.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation, device=logits.device)
        score = float(logprobs.gather(-1, target[:, None]).sum())
        return score, bool((logits.argmax(-1) == target).all())

    def _logits(self, batch: torch.Tensor, prompt_len: int) -> torch.Tensor:
        cfg = self.params.cfg_scale
        if cfg > 0:
            unconditional = batch.clone()
            unconditional[:, :prompt_len] = self.spec.mask_id
            batch = torch.cat([batch, unconditional])
        logits = full_logits(self.spec.logits(self.model, batch))   # log-likelihoods need whole rows
        if cfg > 0:
            conditional, unconditional = logits.chunk(2)
            logits = unconditional + (cfg + 1) * (conditional - unconditional)
        return logits

    def _mc_loglikelihood(self, context: list[int], continuation: list[int],
                          generator: torch.Generator | None) -> float:
        """LLaDA's estimator: E over k of the masked positions' cross-entropy weighted by L/k.
        `generator=None` (`reference_rng=True`): the global RNG, drawn in the reference's order, so a
        run seeded like the reference's replays its numbers."""
        B, L, P = self.mc_batch_size, len(continuation), len(context)
        seq = self._device_ids(context + continuation).repeat(B, 1)
        losses = []
        for _ in range(self.mc_num // B):
            # k stays a tensor, as in the reference: the end of the linspace is then float32
            k = torch.randint(1, L + 1, (), generator=generator)
            counts = torch.round(torch.linspace(float(k), k + (B - 1) * (L / B), steps=B)).long()
            counts = (counts - 1) % L + 1                                 # k spread evenly over the batch
            masked = torch.arange(L).repeat(B, 1) < counts[:, None]
            for row in range(B):
                masked[row] = masked[row][torch.randperm(L, generator=generator)]
            masked = torch.cat([torch.zeros(B, P, dtype=torch.bool), masked], dim=1).to(seq.device)
            noisy = torch.where(masked, torch.full_like(seq, self.spec.mask_id), seq)
            weight = (counts.to(seq.device).float() / L)[:, None].expand(B, P + L)
            logits = self._logits(noisy, P)
            loss = F.cross_entropy(logits[masked].float(), seq[masked], reduction="none") / weight[masked]
            losses.append(float(loss.sum() / B))     # divided in the logits' dtype, as the reference
        return -sum(losses) / len(losses)

    def _greedy_suffix(self, context: list[int], continuation: list[int]) -> bool:
        """Decode the continuation's positions one per step (most confident first): is it the
        continuation?"""
        P, L = len(context), len(continuation)
        seq = self._device_ids(context + [self.spec.mask_id] * L)
        for _ in range(L):
            masked = seq[0] == self.spec.mask_id
            logits = self._logits(seq, P)[0][masked].float()
            x0 = logits.argmax(-1)
            confidence = F.softmax(logits, dim=-1).gather(-1, x0[:, None])[:, 0]
            best = int(torch.argmax(confidence))                  # the lowest index among equals
            positions = masked.nonzero()[:, 0]
            seq[0, positions[best]] = x0[best]
        return seq[0, P:].tolist() == continuation

    @torch.no_grad()
    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        if self.spec.kind != "ar":
            raise NotImplementedError("loglikelihood_rolling is not defined for diffusion models (as in LLaDA's "
                                      "and Dream's own adapters): use generate_until or loglikelihood tasks")
        max_len = getattr(self.model.config, "max_position_embeddings", 2048)
        prefix = getattr(self.tokenizer, "bos_token_id", None)
        prefix = prefix if prefix is not None else self.spec.eos_id
        out = []
        for req in requests:
            tokens = self._encode(req.args[0])
            total = 0.0
            for window in get_rolling_token_windows(tokens, prefix, max_len, 1):
                context, target = make_disjoint_window(window)
                total += self._ar_loglikelihood(context, target)[0]
            out.append(total)
        return out

    def get_model_info(self) -> dict[str, Any]:
        return {"remask_version": getattr(remask, "__version__", "unknown"), "pretrained": self.name,
                "sampling_params": repr(self.params), "mc_num": self.mc_num, "mc_batch_size": self.mc_batch_size,
                "nfe_per_token": getattr(self, "nfe_per_token", None)}
