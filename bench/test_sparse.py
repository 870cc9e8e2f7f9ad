"""Sparse attention: the block-sparse kernel against dense attention, and Sparse-dLLM retention end
to end.

1. Attention of one 32-query block (LLaDA-8B heads: 32 × 128) over T ∈ {1k, 4k, 16k} cached keys:
   dense SDPA over all T (`dense`, the baseline) against a retention step's attention at
   retention 0.5 / 0.3 / 0.1, as remask runs it on the device: on a GPU the Triton kernel over
   token-level index lists into the full K/V (nothing copied); on CPU SDPA over the kept K/V that
   `RetentionKVCache` compacted once at the selection, followed by the block's.
2. `remask.generate` on random LLaDA-format models (the tiny shape and ~100M parameters), prompt
   of 4000 tokens, one block of 32 decoded in 8 steps: no cache (`dense`, the reference decoding
   Sparse-dLLM is measured against), retention 1.0 (every key kept: dense attention over the same
   cache) and retention 0.5 / 0.3. Per-step time = median / NFE; ratios against `dense`, same run.

    make bench            # or: python -m pytest bench/test_sparse.py --benchmark-json=...
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import remask
from conftest import DEVICE, ON_GPU, forward_cost, record_cost, run
from remask.kernels import block_sparse_attention, roofline
from remask.models import LLaDAConfig, LLaDAModelLM
from remask.models.tiny import LLADA_DEFAULTS

H, D, BLOCK = 32, 128, 32
RATIOS = (0.5, 0.3, 0.1)


def kept_lists(T: int, ratio: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level lists `[1, H, 1, n]`: a random ⌊(T − 32)·ratio⌋ of the non-block positions, then
    the block (the last 32 positions), one list shared by all heads (stride 0, as retention)."""
    outside = T - BLOCK
    keep = torch.randperm(outside, generator=generator)[:int(outside * ratio)]
    lst = torch.cat([keep, torch.arange(outside, T)]).to(DEVICE, torch.int32)
    return torch.full((1, H, 1), lst.numel(), dtype=torch.int32, device=DEVICE), lst.view(1, 1, 1, -1).expand(1, H, 1, -1)


@pytest.mark.parametrize("impl", ["dense"] + [f"retention {r}" for r in RATIOS])
@pytest.mark.parametrize("T", [1024, 4096, 16384])
def test_sparse_attention(benchmark, T, impl):
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    g = torch.Generator().manual_seed(T)
    q = torch.randn(1, H, BLOCK, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(1, H, T, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(1, H, T, D, generator=g).to(DEVICE, dtype)
    if impl == "dense":
        fn = lambda: F.scaled_dot_product_attention(q, k, v)   # noqa: E731
        cost = roofline.cost_attention(1, H, BLOCK, T, D, dtype)
    else:
        ratio = float(impl.split()[1])
        num, idx = kept_lists(T, ratio, g)
        cost = roofline.cost_block_sparse_attention(q.shape, H, T, num, idx, q_block_size=BLOCK, kv_block_size=1,
                                                    dtype=dtype)
        if ON_GPU:
            fn = lambda: block_sparse_attention(q, k, v, num, idx, q_block_size=BLOCK, kv_block_size=1)  # noqa: E731
        else:
            kept = idx[0, 0, 0, :-BLOCK].long()
            kk = torch.cat([k[:, :, kept], k[:, :, -BLOCK:]], dim=2)   # compacted once per block, not timed
            vv = torch.cat([v[:, :, kept], v[:, :, -BLOCK:]], dim=2)
            fn = lambda: F.scaled_dot_product_attention(q, kk, vv)   # noqa: E731
    run(benchmark, fn, group=f"attention 32 queries × {T} keys, {H} heads × {D}", kernel="sparse_attention",
        impl=impl, baseline="dense", T=T, cost=cost)


SHAPES = {
    "tiny": dict(d_model=128, n_heads=4, n_kv_heads=4, n_layers=4, mlp_hidden_size=384, vocab_size=128,
                 embedding_size=128, mask_token_id=4),
    "100M": dict(d_model=768, n_heads=12, n_kv_heads=12, n_layers=12, mlp_hidden_size=2304, vocab_size=32768,
                 embedding_size=32768, mask_token_id=32767, weight_tying=True),
}
PROMPT, GEN, STEPS = 4000, 32, 8
MODES = {"dense": None, "retention 1.0": 1.0, "retention 0.5": 0.5, "retention 0.3": 0.3}
_models: dict[str, torch.nn.Module] = {}


def model_for(shape: str) -> torch.nn.Module:
    if shape not in _models:
        config = LLaDAConfig(**{**LLADA_DEFAULTS, "max_sequence_length": 4096, "eos_token_id": 1, "pad_token_id": 1,
                                **SHAPES[shape]})
        torch.manual_seed(0)
        _models[shape] = LLaDAModelLM(config).to(DEVICE, torch.bfloat16 if ON_GPU else torch.float32).eval()
    return _models[shape]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_generate_sparse(benchmark, shape, mode):
    model = model_for(shape)
    vocab = model.config.vocab_size
    prompt = torch.randint(5, vocab - 2, (1, PROMPT), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ratio = MODES[mode]
    sparse = None if ratio is None else remask.SparseConfig(retention_ratio=ratio)
    stats = remask.GenerationStats()

    def call():
        stats.__init__()
        return remask.generate(model, prompt, steps=STEPS, gen_length=GEN, block_length=GEN, sparse=sparse,
                               stats=stats)

    n_params = sum(p.numel() for p in model.parameters())
    run(benchmark, call, rounds=3 if shape == "tiny" or ON_GPU else 1,
        group=f"generate {shape} ({n_params / 1e6:.0f}M) prompt {PROMPT}, {GEN} tokens in {STEPS} steps",
        kernel="sparse_generate", impl=mode, baseline="dense", shape=shape)
    benchmark.extra_info.update(nfe=stats.nfe, kv_cache_bytes=stats.kv_cache_bytes)
    record_cost(benchmark, forward_cost(model, stats))

