"""Rooflines for the kernels: the bytes and flops of one call, hence its lower bound in µs on a GPU.

A kernel call cannot run faster than ``max(bytes / HBM bandwidth, flops / peak rate)``: `Cost`
holds the bytes read + written and the flops of one call, `bound_us(cost, gpu)` that bound. The
benchmarks (`bench/`) record it beside every measured time (`bench/conftest.py`) and
`bench/report.py` prints measured / bound: on a GPU, how far a kernel is from its roofline (1× is
the roofline); on CPU the ratio only says that a CPU is not an A100.

Peak figures (`GPUS`), from NVIDIA's datasheets at boost clock, dense tensor rates (the
datasheets' larger starred figures are 2:4 structured sparsity, which no kernel here uses):

* A100-SXM4-80GB (A100 Tensor Core GPU datasheet, "A100 80GB SXM" column): HBM2e 2,039 GB/s;
  BF16/FP16 tensor 312 TFLOP/s, TF32 tensor 156 TFLOP/s, FP32 (CUDA cores) 19.5 TFLOP/s.
* H100-SXM5-80GB (H100 Tensor Core GPU datasheet, "H100 SXM" column): HBM3 3.35 TB/s;
  BF16/FP16 tensor 989 TFLOP/s, TF32 tensor 494 TFLOP/s, FP32 67 TFLOP/s.
* H200-SXM-141GB (H200 Tensor Core GPU datasheet, "H200 SXM" column): HBM3e 4.8 TB/s;
  BF16/FP16 tensor 989 TFLOP/s, TF32 tensor 494 TFLOP/s, FP32 67 TFLOP/s (the H100's compute).

`gpu_for_device(torch.cuda.get_device_name())` picks the entry of the device a run is on (None for
any other device: PCIe and NVL boards have other peaks).

Assumptions, all of which make the bound lower (never higher) than what is achievable:

* Bytes are DRAM traffic with perfect reuse: each input byte the kernel needs is read once and each
  output byte written once (a K/V row read by several query heads or tiles counts once; L2 hits
  are free) — except where the kernel's own design reads an input twice (`credit_confidence`'s two
  passes over the logits, `logit_passes`). Peak HBM bandwidth is not reachable in practice (a
  large copy gets less of it: `bench/conftest.py` measures the device's copy bandwidth).
* Tensor-core flops count 2 per multiply-add of useful work only (keys a mask hides, padding of
  partial tiles and pages are not counted). The attention kernels feed bf16 / fp16 Q, K, V (and
  P) to `tl.dot` as they are, accumulating in float32 (kind ``bf16``), and float32 inputs as
  float32 FMAs on the CUDA cores (``input_precision="ieee"``, never TF32: kind ``fp32``):
  `attention_flop_kind` (docs/kernels.md, compiled-code gate).
* CUDA-core work (``fp32``: the streaming kernels' max / compare / select / exp / log and the
  integer ops of Philox and of sorting) counts one op per Triton vector operation in the kernel's
  source, against the FMA-counted (2 per lane-cycle) FP32 peak; int64 ops, transcendentals (¼ rate
  SFU) and address arithmetic are not weighted. So these compute bounds are optimistic by 2× or
  more — still lower bounds. Per-element counts are the ``OPS_*`` constants below.
* Launch overhead (a few µs per launch) is not included: a bound below ~5 µs means the call is
  launch-bound in practice.
* Sequential kernels add (`Cost.__add__`): the bound of the sum is at most the sum of the bounds.

Cost functions, one per kernel family, from the call's arguments (shapes, dtypes, counts):
`cost_confidence`, `cost_unmask`, `cost_accept`, `cost_canvas_score`, `cost_canvas_update`,
`cost_credit_confidence`, `cost_dinfer_select`, `cost_paged_attention`, `cost_attention` (dense),
`cost_block_sparse_attention`, `cost_philox`, and `cost_forward` (a model forward's weight reads
and matmul flops, for the end-to-end benchmarks).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

__all__ = ["GPU", "GPUS", "gpu_for_device", "Cost", "bound_us", "limit", "extra_info", "flop_kind_for",
           "cost_confidence", "cost_unmask", "cost_accept", "cost_canvas_score", "cost_canvas_update",
           "cost_credit_confidence", "cost_dinfer_select", "cost_paged_attention", "cost_attention",
           "cost_block_sparse_attention", "cost_philox", "cost_forward"]

FLOP_KINDS = ("bf16", "tf32", "fp32")


@dataclass(frozen=True)
class GPU:
    name: str
    hbm_bytes_per_s: float
    flops_per_s: Mapping[str, float]   # by flop kind: "bf16" (also fp16), "tf32", "fp32"


GPUS: dict[str, GPU] = {
    "a100": GPU("A100-SXM4-80GB", 2.039e12, {"bf16": 312e12, "tf32": 156e12, "fp32": 19.5e12}),
    "h100": GPU("H100-SXM5-80GB", 3.35e12, {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
    "h200": GPU("H200-SXM-141GB", 4.8e12, {"bf16": 989e12, "tf32": 494e12, "fp32": 67e12}),
}


def gpu_for_device(name: str) -> str | None:
    """The `GPUS` key of a device by its CUDA name (`torch.cuda.get_device_name`): the SXM boards
    ("NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3", "NVIDIA H200"); None for any other device,
    PCIe and NVL boards included (their bandwidth and clocks differ from the SXM datasheet's)."""
    upper = name.upper()
    if any(tag in upper for tag in ("PCIE", "NVL")):
        return None
    if "H200" in upper:
        return "h200"
    if "H100" in upper:
        return "h100"
    if "A100" in upper and "80GB" in upper:
        return "a100"
    return None


# CUDA-core ops per element, one per Triton vector operation of the kernel source (module docstring).
OPS_ARGMAX = 6        # reductions.argmax_lowest: where, max, ==, &, where, min
OPS_RUNNER_UP = 9     # confidence's margin mode: a second argmax_lowest + where/max of the runner-up
OPS_SOFTMAX = 7       # reductions.online_softmax: finite test, where, sub, where, exp, where, sum
OPS_ENTROPY = 2       # its Σ e·(x − m) term: mul, sum
OPS_GATHER = 3        # the logit at the chunk's argmax: ==, where, max
OPS_PHILOX = 86       # tl.rand: the offset (mul, add), 10 rounds × (2 umulhi, 2 mul, 4 xor), to-uniform (4)
OPS_GUMBEL = 6        # l − T·log(−log u): log, neg, log, mul, sub, where
OPS_SORT_EXCHANGE = 3  # one compare-exchange of tl.sort's bitonic network: compare, two selects
OPS_PAIR_COUNT = 3    # unmask's counting path, per (i, j) pair: one packed int64 >, convert, sum
OPS_PAIR_COUNT_F64 = 7  # the same for float64 confidences: >, ==, <, &, |, convert, sum
OPS_SCAN_STAGE = 2    # one stage of tl.associative_scan / tl.cumsum per lane: combine, select


@dataclass(frozen=True)
class Cost:
    """One call's DRAM bytes (read + written) and flops of one kind ("bf16", "tf32" tensor-core
    or "fp32" CUDA-core work)."""
    bytes: float
    flops: float = 0.0
    flop_kind: str = "fp32"

    def __post_init__(self):
        if self.flop_kind not in FLOP_KINDS:
            raise ValueError(f"flop_kind must be one of {FLOP_KINDS}, got {self.flop_kind!r}")
        if self.bytes < 0 or self.flops < 0:
            raise ValueError(f"bytes and flops must be >= 0, got {self.bytes} and {self.flops}")

    def __add__(self, other: "Cost") -> "Cost":
        """Two kernels run one after the other (same flop kind, or one of them without flops)."""
        if self.flops and other.flops and self.flop_kind != other.flop_kind:
            raise ValueError(f"cannot add {self.flop_kind} and {other.flop_kind} flops into one Cost")
        return Cost(self.bytes + other.bytes, self.flops + other.flops,
                    self.flop_kind if self.flops else other.flop_kind)


def _gpu(gpu: str | GPU) -> GPU:
    return gpu if isinstance(gpu, GPU) else GPUS[gpu.lower()]


def bound_us(cost: Cost, gpu: str | GPU) -> float:
    """max(bytes / HBM bandwidth, flops / peak rate of the cost's kind), in µs."""
    g = _gpu(gpu)
    return 1e6 * max(cost.bytes / g.hbm_bytes_per_s, cost.flops / g.flops_per_s[cost.flop_kind])


def limit(cost: Cost, gpu: str | GPU) -> str:
    """Which side of the roofline binds: "memory" or "compute"."""
    g = _gpu(gpu)
    return "compute" if cost.flops / g.flops_per_s[cost.flop_kind] > cost.bytes / g.hbm_bytes_per_s else "memory"


def extra_info(cost: Cost) -> dict:
    """The benchmark JSON's fields for one call: bytes, flops, flop_kind, bound_us_<gpu>, limit_<gpu>."""
    info: dict = dict(bytes=int(cost.bytes), flops=int(cost.flops), flop_kind=cost.flop_kind)
    for key in GPUS:
        info[f"bound_us_{key}"] = bound_us(cost, key)
        info[f"limit_{key}"] = limit(cost, key)
    return info


def flop_kind_for(dtype: torch.dtype) -> str:
    """The tensor-core kind a torch matmul of `dtype` runs at: bf16/fp16 → "bf16"; float32 →
    "fp32" (torch's default leaves TF32 off for matmuls; a Triton `tl.dot` would turn it on, which
    remask's kernels never let it: they pass ``input_precision="ieee"`` for float32)."""
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"


def attention_flop_kind(dtype: torch.dtype) -> str:
    """The dot kind of remask's attention kernels for q/k/v of `dtype`: bf16 / fp16 operands go to
    the tensor cores as they are ("bf16": the 16-bit rate), float32 ones to float32 FMAs
    (``input_precision="ieee"``: "fp32", the CUDA-core rate; `tl.dot`'s TF32 default would be ~1e-3
    off the float32 reference)."""
    return "bf16" if dtype in (torch.bfloat16, torch.float16) else "fp32"


def _size(dtype: torch.dtype | int) -> int:
    if isinstance(dtype, int):
        return dtype
    return torch.empty((), dtype=dtype).element_size()


def _rows(shape: int | Sequence[int]) -> int:
    return shape if isinstance(shape, int) else math.prod(shape)


def _sort_ops(n: int) -> float:
    """CUDA-core ops of `tl.sort` over n lanes (a power of two): a bitonic network of
    log n·(log n + 1)/2 stages of n/2 compare-exchanges."""
    lg = max(1, int(n - 1).bit_length())
    return OPS_SORT_EXCHANGE * (n / 2) * lg * (lg + 1) / 2


def _p2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


# ---------------------------------------------------------------------------------------------
# Streaming kernels over the vocabulary

def cost_confidence(rows: int | Sequence[int], vocab: int, dtype: torch.dtype = torch.bfloat16, *,
                    temperature: float = 0.0, noise_dtype: torch.dtype | None = None, mode: str = "prob",
                    row_index: bool = False, n_argmax_ids: int = 0, n_softmax_ids: int = 0,
                    out_dtype: torch.dtype = torch.float32, num_splits: int = 1) -> Cost:
    """`confidence` over `rows` scored rows (an int, or the leading shape ``[B, N]``) of `vocab`
    logits of `dtype` (`confidence_fwd_kernel`): each scored row's logits read once (only the rows
    `rows=` selects, never the others), injected uniforms of `noise_dtype` read likewise at T > 0
    (None: Philox in the kernel, no bytes, `OPS_PHILOX` per element), the row index (int64) and
    the id lists read, x0 (int64) and conf (`out_dtype`) written; with `num_splits` > 1 the
    partial state (6 float32 + 1 int32 per row and split) is written and read back by the combine
    kernel."""
    n = _rows(rows)
    elems = n * vocab
    nbytes = elems * _size(dtype) + n * (8 + _size(out_dtype))
    nbytes += 8 * n if row_index else 0
    nbytes += 8 * (n_argmax_ids + n_softmax_ids)
    nbytes += 2 * 28 * n * num_splits if num_splits > 1 else 0
    ops = 1 + OPS_ARGMAX + OPS_GATHER + 1 + OPS_SOFTMAX          # upcast, selection, x0 logit, chunk max, softmax
    ops += OPS_ENTROPY if mode == "neg_entropy" else OPS_RUNNER_UP if mode == "margin" else 0
    ops += 2 * (n_argmax_ids + n_softmax_ids)                    # _hits: ==, | per id
    if temperature > 0:
        if noise_dtype is not None:
            nbytes += elems * _size(noise_dtype)
            ops += 1 + OPS_GUMBEL
        else:
            ops += OPS_PHILOX + OPS_GUMBEL
    return Cost(nbytes, elems * ops, "fp32")


def cost_accept(rows: int, vocab: int, dllm_dtype: torch.dtype = torch.bfloat16,
                verifier_dtype: torch.dtype | None = None, *, temperature: float = 0.0,
                noise_dtype: torch.dtype = torch.float32, num_splits: int = 1) -> Cost:
    """`apd_accept` over `rows` draft positions and the shared `vocab` (`apd_accept_fwd_kernel`):
    both logit rows read over the shared vocabulary only (columns past it never), the uniforms at
    T > 0, the draft (int64) read, the target (int64) and the accepted length (int32) written;
    partial argmaxes (float32 + int32 per row and split) with `num_splits` > 1."""
    verifier_dtype = dllm_dtype if verifier_dtype is None else verifier_dtype
    elems = rows * vocab
    nbytes = elems * (_size(dllm_dtype) + _size(verifier_dtype)) + 16 * rows + 4
    nbytes += 2 * 8 * rows * num_splits if num_splits > 1 else 0
    ops = 2 + 3 + 1 + OPS_ARGMAX        # two upcasts, w·l_d + w'·l_a (mul, fma = 3), where, argmax
    if temperature > 0:
        nbytes += elems * _size(noise_dtype)
        ops += 1 + OPS_GUMBEL
    return Cost(nbytes, elems * ops, "fp32")


def cost_canvas_score(rows: int | Sequence[int], vocab: int, dtype: torch.dtype = torch.bfloat16, *,
                      noise_dtype: torch.dtype | None = None) -> Cost:
    """`canvas_score` (`canvas_score_kernel`): each row's logits read once (uniforms too when
    injected, else Philox in the kernel), sample and argmax (int64), entropy and top_prob (float32)
    written. Per element: upcast, ÷T, the noise, the Gumbel score, two argmaxes, the softmax with
    its entropy term."""
    n = _rows(rows)
    elems = n * vocab
    nbytes = elems * _size(dtype) + 24 * n
    ops = 2 + OPS_GUMBEL + 2 * OPS_ARGMAX + OPS_SOFTMAX + OPS_ENTROPY
    if noise_dtype is not None:
        nbytes += elems * _size(noise_dtype)
        ops += 1
    else:
        ops += OPS_PHILOX
    return Cost(nbytes, elems * ops, "fp32")


def cost_canvas_update(batch: int, length: int, *, noise_tokens: bool = False) -> Cost:
    """`canvas_update` (`canvas_update_kernel`, one program per row): entropy (float32) and sample
    (int64) read, the new canvas (int64) and accepted flags (int8) written, injected noise tokens
    (int64) read or Philox `randint` drawn per position; a `tl.sort` of next_power_of_2(L) int64
    keys and a cumsum per row."""
    n = batch * length
    nbytes = n * (4 + 8 + 8 + 1) + (8 * n if noise_tokens else 0)
    ops = batch * (_sort_ops(_p2(length)) + 2 * _p2(length)) + n * (8 + (1 if noise_tokens else OPS_PHILOX + 2))
    return Cost(nbytes, ops, "fp32")


def cost_credit_confidence(batch: int, length: int, vocab: int, dtype: torch.dtype = torch.float32, *,
                           logit_passes: int = 2) -> Cost:
    """`credit_confidence` (`credit_confidence_kernel`, one program per row of `[B, L, V]`): the
    logits read twice (pass 1: raw argmax and probability; pass 2: the fused scores — the kernel's
    two loads, `logit_passes`=1 for the one-read ideal), the float32 credit read and written once
    (pass 2), the mask converted to int8 by the launcher (bool read, int8 written and read), x0
    (int64) and conf (float32) written. Per element: pass 1 upcast + argmax + softmax; pass 2
    upcast, decay, boost, log(1 + c), fma, where, argmax, softmax."""
    rows = batch * length
    elems = rows * vocab
    nbytes = elems * (logit_passes * _size(dtype) + 8) + rows * (3 + 12)
    ops = (1 + OPS_ARGMAX + OPS_SOFTMAX) + (1 + 2 + 3 + 2 + 2 + 1 + OPS_ARGMAX + OPS_SOFTMAX)
    return Cost(nbytes, elems * ops, "fp32")


def cost_dinfer_select(batch: int, length: int, rule: str = "threshold") -> Cost:
    """`dinfer_select` (`dinfer_select_kernel`, one program per row): x, x0 (int64) and conf
    (float32) read, x written back whole (int64). The hierarchical rule adds a run-id cumsum and
    the segmented max scans (a forward and a reverse `tl.associative_scan` of packed int64 keys)
    over next_power_of_2(L) lanes."""
    n = batch * length
    ops = n * 10
    if rule == "hierarchy":
        lanes = max(16, _p2(length))
        ops += batch * (3 * OPS_SCAN_STAGE * lanes * max(1, (lanes - 1).bit_length()) + 12 * lanes)
    return Cost(n * (8 + 8 + 4 + 8), ops, "fp32")


def cost_unmask(batch: int, length: int, conf_dtype: torch.dtype = torch.float32, *, committed: int,
                has_k: bool = True, rule: str | None = None, path: str | None = None) -> Cost:
    """`unmask` (one program per row, `unmask_kernel` / `unmask_sort_kernel`): the mask (uint8)
    and confidences read once (the counting path re-reads them in tiles, from cache), the budget k
    (int64, `has_k`) and the rule's thresholds (`rule` "threshold": one float64; "factor": `[L]`
    float64, shared by the rows) read, x0 read and x (int64) and the mask (uint8) written at the
    `committed` positions only (their total over the rows), the count (int64) written.

    Ops: the counting path compares every pair of positions (`OPS_PAIR_COUNT`, float64
    `OPS_PAIR_COUNT_F64`, per pair: L² per row); the sort path packs keys and runs a bitonic
    `tl.sort` of next_power_of_2(L) lanes (two for float64 confidences). `path` None takes the dispatcher's choice (`unmask.sort_path`)."""
    from .unmask import sort_path   # the dispatcher's rule, not a copy of it

    n = batch * length
    nbytes = n * (1 + _size(conf_dtype)) + batch * 8 + 17 * committed
    nbytes += batch * 8 if has_k else 0
    nbytes += 8 if rule == "threshold" else 8 * length if rule == "factor" else 0
    if path is None:
        path = "sort" if sort_path(conf_dtype, length) else "count"
    if path == "sort":
        sorts = 2 if conf_dtype == torch.float64 else 1
        ops = batch * (sorts * _sort_ops(_p2(length)) + 12 * _p2(length))
    else:
        pair = OPS_PAIR_COUNT_F64 if conf_dtype == torch.float64 else OPS_PAIR_COUNT
        ops = batch * (length * length * pair + 12 * length)
    return Cost(nbytes, ops, "fp32")


def cost_philox(draws: int, *, gumbel: bool = True, out_dtype: torch.dtype = torch.float32,
                draws_per_philox: int = 1) -> Cost:
    """`draws` seeded uniforms (→ Gumbel noise when `gumbel`), written once as `out_dtype`; nothing
    read (the counters are computed). Triton's `tl.rand` keeps one of the four words of a
    Philox4x32-10 call per offset (`draws_per_philox`=1, `OPS_PHILOX` per draw); torch's own CUDA
    generator uses all four (`draws_per_philox`=4)."""
    ops = OPS_PHILOX / draws_per_philox + (4 if gumbel else 0)     # −log(−log u): log, neg, log, neg
    return Cost(draws * _size(out_dtype), draws * ops, "fp32")


# ---------------------------------------------------------------------------------------------
# Attention

def cost_attention(batch: int, q_heads: int, q_len: int, k_len: int, head_dim: int,
                   dtype: torch.dtype = torch.bfloat16, *, kv_heads: int | None = None,
                   flop_kind: str | None = None) -> Cost:
    """Dense attention (SDPA, flash-style): Q read and O written once, K and V of each KV head
    read once; QKᵀ and PV at 2·D flops per (query, key) pair each. `flop_kind` default: the
    dtype's torch matmul kind (`flop_kind_for`)."""
    kv_heads = q_heads if kv_heads is None else kv_heads
    size = _size(dtype)
    nbytes = size * head_dim * (2 * batch * q_heads * q_len + 2 * batch * kv_heads * k_len)
    flops = 4 * head_dim * batch * q_heads * q_len * k_len
    return Cost(nbytes, flops, flop_kind or flop_kind_for(dtype))


def cost_paged_attention(seq_lens: Sequence[int], q_len: int, q_heads: int, kv_heads: int, head_dim: int,
                         dtype: torch.dtype = torch.bfloat16, *, n_new: int | None = None,
                         block_size: int | None = None, page_size: int = 16, cache_dtype: torch.dtype | None = None,
                         table_itemsize: int = 4, flop_kind: str | None = None) -> Cost:
    """`paged_attention` (`paged_attention_kernel`) of `q_len` queries per sequence over its
    `seq_lens[b]` cached positions and `n_new` fresh keys (default: q_len; 0 for none): Q read and
    O written once, each KV head's cached rows (only the valid ones of its pages, `cache_dtype`)
    and fresh rows read once, the block table's entries for the pages used and seq_lens read.
    Flops: 4·D per visible (query, key) pair and query head — every cached key, and the fresh keys
    (all of them; with `block_size`, block-causal: fresh key j is visible to query i when
    ``(len + j) // block_size <= (len + i) // block_size``). Kind: `attention_flop_kind(dtype)`
    unless `flop_kind` says otherwise."""
    n_new = q_len if n_new is None else n_new
    size, csize = _size(dtype), _size(cache_dtype or dtype)
    B = len(seq_lens)
    cached = sum(seq_lens)
    nbytes = 2 * size * B * q_len * q_heads * head_dim                     # Q, O
    nbytes += 2 * csize * cached * kv_heads * head_dim                     # cached K, V
    nbytes += 2 * size * B * n_new * kv_heads * head_dim                   # fresh K, V
    nbytes += table_itemsize * sum(-(-n // page_size) for n in seq_lens) + 4 * B
    pairs = 0
    for n in seq_lens:
        if block_size is None:
            pairs += q_len * (n + n_new)
        else:
            pairs += sum(n + min(n_new, ((n + i) // block_size + 1) * block_size - n) for i in range(q_len))
    return Cost(nbytes, 4 * head_dim * q_heads * pairs, flop_kind or attention_flop_kind(dtype))


def cost_block_sparse_attention(q_shape: Sequence[int], kv_heads: int, k_len: int, kv_num_blocks: torch.Tensor,
                                kv_indices: torch.Tensor, *, q_block_size: int, kv_block_size: int,
                                dtype: torch.dtype = torch.bfloat16, kv_len: Sequence[int] | None = None,
                                paged: bool = False, table_itemsize: int = 4, flop_kind: str | None = None) -> Cost:
    """`block_sparse_attention` (`block_sparse_attention_kernel`) for q `[B, Hq, Lq, D]` over K/V of
    `k_len` positions (paged: the logical capacity, block table width × kv_block_size) and the
    block lists (`kv_num_blocks` `[B, Hq, n_q_blocks]`, `kv_indices` `[B, Hq, n_q_blocks, max]`,
    any strides). Bytes: Q read and O written once; the K and V rows of the union of the blocks
    listed for each (sequence, KV head) — over its query heads and query blocks — read once
    (positions ≥ kv_len or k_len never); the counts and the listed index entries read once per
    distinct list in memory (lists shared through stride 0 count once), and with `paged` one block
    table entry (`table_itemsize`) per listed block. Flops: 4·D per (query row, listed key position)
    pair, of `attention_flop_kind(dtype)` unless `flop_kind` says otherwise."""
    B, Hq, Lq, D = q_shape
    size = _size(dtype)
    group = Hq // kv_heads
    n_qb = kv_num_blocks.shape[2]
    n_kv_blocks = -(-k_len // kv_block_size)
    counts = kv_num_blocks.clamp(0, kv_indices.shape[3]).cpu()
    nbytes = 2 * size * B * Hq * Lq * D
    pairs = 0
    kv_positions = 0
    lists: dict[int, int] = {}       # a list's offset in kv_indices' memory → entries read
    seen_counts: set[int] = set()
    table_entries = 0
    for b in range(B):
        lim = k_len if kv_len is None else min(k_len, int(kv_len[b]))
        for kvh in range(kv_heads):
            union = []
            for h in range(kvh * group, (kvh + 1) * group):
                for qb in range(n_qb):
                    c = int(counts[b, h, qb])
                    seen_counts.add(b * kv_num_blocks.stride(0) + h * kv_num_blocks.stride(1)
                                    + qb * kv_num_blocks.stride(2))
                    ids = kv_indices[b, h, qb, :c].long().cpu()
                    offset = b * kv_indices.stride(0) + h * kv_indices.stride(1) + qb * kv_indices.stride(2)
                    lists[offset] = max(lists.get(offset, 0), c)
                    ids = ids[(ids >= 0) & (ids < n_kv_blocks)]
                    union.append(ids)
                    width = (lim - ids * kv_block_size).clamp(0, kv_block_size)
                    rows = max(0, min(q_block_size, Lq - qb * q_block_size))
                    pairs += rows * int(width.sum())
            ids = torch.unique(torch.cat(union)) if union else torch.zeros(0, dtype=torch.long)
            kv_positions += int((lim - ids * kv_block_size).clamp(0, kv_block_size).sum())
            if paged:
                table_entries += ids.numel()
    nbytes += 2 * size * kv_positions * D
    nbytes += kv_indices.element_size() * sum(lists.values()) + kv_num_blocks.element_size() * len(seen_counts)
    nbytes += table_itemsize * table_entries
    return Cost(nbytes, 4 * D * pairs, flop_kind or attention_flop_kind(dtype))


# ---------------------------------------------------------------------------------------------
# End to end

def cost_forward(matmul_params: int, positions: int, forwards: int = 1,
                 dtype: torch.dtype = torch.bfloat16) -> Cost:
    """Model forwards, their matmuls only: `forwards` reads of the `matmul_params` weights (linear
    layers and a tied LM head) and 2 flops per weight per position computed (`positions`, summed
    over the forwards). Attention, activations, the KV cache and the sampler are left out: a lower
    bound for `remask.generate` and the like."""
    return Cost(forwards * matmul_params * _size(dtype), 2 * matmul_params * positions, flop_kind_for(dtype))
