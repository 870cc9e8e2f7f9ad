"""Triton kernels, each with a torch reference beside it (`*_ref.py`), the CPU runtime and the
tests' oracle.

* `confidence(logits, ...)` → (x0, conf): fused scoring over the vocabulary (`confidence.py`).
* `unmask(x, mask, x0, conf, k=|threshold=|factor=)` → counts: selection and commit in one launch
  (`unmask.py`).
* `apd_accept(draft, dllm_logits, verifier_logits, R)` → (target, accepted length): APD's mixture
  argmax and acceptance test in one pass (`accept.py`).
* `canvas_score(logits, T)` → (sample, argmax, entropy, top_prob) and `canvas_update(sample,
  entropy, bound, vocab_size=)` → (canvas, accepted): uniform-noise diffusion's step (DiffusionGemma:
  one pass over V; the EB decision and the renoise in one launch) (`canvas.py`).
* `credit_confidence(logits, credit, masked, first, alpha, gamma, beta)` → (x0, conf) and
  `dinfer_select(x, x0, conf, mask_id, rule, threshold, low_threshold)`: dInfer's credit update and
  fusion in one pass pair over V, and its threshold / hierarchical commit in one launch per block
  (`dinfer.py`).
* `invariant_linear(x, weight, bias)` and `invariant_rms_norm(x, weight, eps)`: batch-invariant GEMM
  and RMSNorm, each output row bitwise independent of the other rows of the launch (tile shape and
  reduction order fixed by the weight's shape, never by the row count) (`invariant_matmul.py`,
  `invariant_norm.py`).
* `paged_store`, `paged_gather`, `paged_attention`: the paged KV cache (`paged.py`; layout
  `[num_pages, page_size, H_kv, D]` with a block table per sequence).
* `block_sparse_attention(q, k, v, kv_num_blocks, kv_indices, ...)`: bidirectional attention under a
  FlexAttention-style block mask (per query block, a list of KV blocks or single tokens), K/V read in
  place, contiguous or paged (`sparse_attention.py`).
* `varlen_attention(q, k, v, cu_seqlens, k_cache=, v_cache=, block_table=, cache_lens=, block_sizes=,
  mask=, mask_offsets=)`: one launch for a pack of requests, each query row over its own request's
  paged cache and in-forward K/V under its own mask kind (bidirectional, causal, block-causal, own
  boolean masks), each row's reduction order independent of the pack (`varlen_attention.py`).

Triton runs on CUDA tensors; ``REMASK_TRITON=1`` forces it (CPU tensors under
``TRITON_INTERPRET=1``), ``REMASK_TRITON=0`` forces the torch references.
"""
from .accept import apd_accept
from .canvas import canvas_score, canvas_update
from .confidence import confidence
from .dinfer import credit_confidence, dinfer_select
from .invariant_matmul import invariant_linear
from .invariant_norm import invariant_rms_norm
from .paged import paged_attention, paged_gather, paged_store
from .sparse_attention import block_sparse_attention
from .unmask import unmask
from .varlen_attention import varlen_attention

__all__ = ["apd_accept", "block_sparse_attention", "canvas_score", "canvas_update", "confidence", "credit_confidence",
           "dinfer_select", "invariant_linear", "invariant_rms_norm", "paged_attention", "paged_gather", "paged_store",
           "unmask", "varlen_attention"]
