"""`remask.kernels.roofline`: the cost functions on hand-counted small cases, the bound's arithmetic,
and the benchmarks' use of them (every bench/test_*.py case records a roofline; a fast case of each
kernel benchmark runs and `bench/report.py` prints its bounds)."""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from remask.kernels import roofline as rl
from remask.kernels.roofline import Cost, bound_us

ROOT = os.path.join(os.path.dirname(__file__), "..")
BENCH = os.path.join(ROOT, "bench")


# --- the bound -------------------------------------------------------------------------------------

def test_bound_is_the_slower_of_memory_and_compute():
    assert bound_us(Cost(2.039e12), "a100") == pytest.approx(1e6)           # one second of A100 HBM
    assert bound_us(Cost(3.35e12), "h100") == pytest.approx(1e6)
    assert bound_us(Cost(0, 19.5e12, "fp32"), "a100") == pytest.approx(1e6)
    assert bound_us(Cost(0, 989e12, "bf16"), "h100") == pytest.approx(1e6)
    assert bound_us(Cost(0, 494e12, "tf32"), "H100") == pytest.approx(1e6)
    # 2.039 MB and 312 MFLOP of bf16: 1 µs each on an A100, so 1 µs; 4.078 MB: memory binds at 2 µs
    assert bound_us(Cost(2.039e6, 312e6, "bf16"), "a100") == pytest.approx(1.0)
    cost = Cost(4.078e6, 312e6, "bf16")
    assert bound_us(cost, "a100") == pytest.approx(2.0)
    assert rl.limit(cost, "a100") == "memory"
    assert rl.limit(Cost(1, 1e9, "fp32"), "h100") == "compute"
    info = rl.extra_info(cost)
    assert info["bytes"] == 4078000 and info["flops"] == 312000000 and info["flop_kind"] == "bf16"
    assert info["bound_us_a100"] == pytest.approx(2.0)
    assert info["bound_us_h100"] == pytest.approx(max(4.078e6 / 3.35e12, 312e6 / 989e12) * 1e6)
    assert info["limit_a100"] == info["limit_h100"] == "memory"
    json.dumps(info)   # goes into pytest-benchmark's JSON


def test_cost_addition_and_validation():
    assert Cost(10, 5) + Cost(6, 1) == Cost(16, 6, "fp32")
    assert Cost(10) + Cost(6, 4, "tf32") == Cost(16, 4, "tf32")        # no flops: takes the other's kind
    with pytest.raises(ValueError, match="cannot add"):
        Cost(1, 1, "bf16") + Cost(1, 1, "fp32")
    with pytest.raises(ValueError, match="flop_kind"):
        Cost(1, 1, "int8")
    with pytest.raises(ValueError):
        Cost(-1)
    assert rl.flop_kind_for(torch.bfloat16) == rl.flop_kind_for(torch.float16) == "bf16"
    assert rl.flop_kind_for(torch.float32) == "fp32"


# --- the cost functions, counted by hand -------------------------------------------------------------

def test_confidence_cost():
    # [2, 3, 1000] float32 logits: 6 rows of 1000 × 4 bytes read, x0 int64 + conf float32 written
    cost = rl.cost_confidence((2, 3), 1000, torch.float32)
    assert cost.bytes == 6 * 1000 * 4 + 6 * (8 + 4) == 24072
    per_element = 1 + rl.OPS_ARGMAX + rl.OPS_GATHER + 1 + rl.OPS_SOFTMAX
    assert cost.flops == 6000 * per_element and cost.flop_kind == "fp32"
    assert rl.cost_confidence(6, 1000, torch.float32) == cost
    # bf16, a row index, Philox sampling (no bytes, OPS_PHILOX per element), float64 out
    cost = rl.cost_confidence(6, 1000, torch.bfloat16, temperature=0.7, row_index=True, out_dtype=torch.float64)
    assert cost.bytes == 6 * 1000 * 2 + 6 * (8 + 8) + 6 * 8
    assert cost.flops == 6000 * (per_element + rl.OPS_PHILOX + rl.OPS_GUMBEL)
    # injected float32 uniforms are read like the logits; entropy and margin add their ops
    cost = rl.cost_confidence(6, 1000, torch.bfloat16, temperature=0.7, noise_dtype=torch.float32)
    assert cost.bytes == 6 * 1000 * (2 + 4) + 6 * 12
    assert rl.cost_confidence(6, 1000, mode="neg_entropy").flops == 6000 * (per_element + rl.OPS_ENTROPY)
    assert rl.cost_confidence(6, 1000, mode="margin").flops == 6000 * (per_element + rl.OPS_RUNNER_UP)
    # id lists: 8 bytes per id; splits: 28 bytes of partial state per row and split, written and read
    assert rl.cost_confidence(6, 1000, torch.bfloat16, n_argmax_ids=2, num_splits=3).bytes == \
        6 * 1000 * 2 + 6 * 12 + 16 + 2 * 28 * 6 * 3


def test_accept_cost():
    # 4 drafts, shared vocabulary 10: bf16 and float32 rows read, draft and target int64, length int32
    cost = rl.cost_accept(4, 10, torch.bfloat16, torch.float32)
    assert cost.bytes == 40 * (2 + 4) + 4 * 16 + 4 == 308
    assert cost.flops == 40 * (2 + 3 + 1 + rl.OPS_ARGMAX)
    assert rl.cost_accept(4, 10, torch.bfloat16, temperature=1.0).bytes == 40 * (2 + 2 + 4) + 68


def test_unmask_cost():
    # B=2, L=8 float32: mask + conf read (5 bytes a position), k and count (8 + 8 a row), 3 commits
    # of x0 read, x written (int64) and the mask cleared (1 byte)
    cost = rl.cost_unmask(2, 8, torch.float32, committed=3)
    assert cost.bytes == 16 * 5 + 2 * 16 + 3 * 17 == 163
    assert cost.flops == 2 * (8 * 8 * rl.OPS_PAIR_COUNT + 12 * 8)        # L < 512: the counting path
    assert rl.cost_unmask(2, 8, torch.float64, committed=0, path="count").flops == \
        2 * (64 * rl.OPS_PAIR_COUNT_F64 + 96)
    assert rl.cost_unmask(2, 8, committed=3, has_k=False, rule="threshold").bytes == 163 - 16 + 8
    assert rl.cost_unmask(2, 8, committed=3, has_k=False, rule="factor").bytes == 163 - 16 + 64
    # L = 1024 takes the sort path: a bitonic network of 10·11/2 stages of 512 compare-exchanges
    sort_ops = rl.OPS_SORT_EXCHANGE * 512 * 10 * 11 / 2
    assert rl.cost_unmask(1, 1024, torch.float32, committed=0).flops == sort_ops + 12 * 1024
    assert rl.cost_unmask(1, 1000, torch.float64, committed=0, path="sort").flops == 2 * sort_ops + 12 * 1024


def test_canvas_and_dinfer_costs():
    cost = rl.cost_canvas_score(3, 10, torch.bfloat16)                   # sample, argmax, entropy, top_prob
    assert cost.bytes == 30 * 2 + 3 * 24
    assert rl.cost_canvas_score(3, 10, torch.bfloat16, noise_dtype=torch.float32).bytes == 30 * 6 + 72
    assert rl.cost_canvas_update(2, 3).bytes == 6 * (4 + 8 + 8 + 1)
    assert rl.cost_canvas_update(2, 3, noise_tokens=True).bytes == 6 * 29
    # credit: logits read twice (two passes), credit float32 read + written, mask bool→int8→read, x0 + conf
    assert rl.cost_credit_confidence(1, 2, 10, torch.float32).bytes == 20 * (2 * 4 + 8) + 2 * 15 == 350
    assert rl.cost_credit_confidence(1, 2, 10, torch.bfloat16, logit_passes=1).bytes == 20 * 10 + 30
    assert rl.cost_dinfer_select(2, 4).bytes == 8 * (8 + 8 + 4 + 8)
    assert rl.cost_dinfer_select(2, 4, "hierarchy").flops > rl.cost_dinfer_select(2, 4).flops


def test_philox_and_forward_costs():
    assert rl.cost_philox(100) == Cost(400, 100 * (rl.OPS_PHILOX + 4), "fp32")
    assert rl.cost_philox(100, gumbel=False, draws_per_philox=4).flops == 100 * rl.OPS_PHILOX / 4
    assert rl.cost_forward(1000, 10, 2, torch.bfloat16) == Cost(2 * 1000 * 2, 2 * 1000 * 10, "bf16")
    assert rl.cost_forward(1000, 10, 1, torch.float32) == Cost(4000, 20000, "fp32")


def test_dense_and_paged_attention_costs():
    # B=1, 2 heads, 3 queries over 5 keys, D=4, float32: Q/O 2·(2·3·4·4), K/V 2·(2·5·4·4); 4·D per pair
    cost = rl.cost_attention(1, 2, 3, 5, 4, torch.float32)
    assert cost.bytes == 2 * 2 * 3 * 16 + 2 * 2 * 5 * 16 == 512
    assert cost.flops == 4 * 4 * 2 * 3 * 5 and cost.flop_kind == "fp32"
    assert rl.cost_attention(1, 2, 3, 5, 4, torch.bfloat16, kv_heads=1).bytes == 2 * 2 * 3 * 8 + 2 * 1 * 5 * 8
    # paged: sequences of 3 and 5 cached positions (pages of 4), 2 queries and 2 fresh keys each,
    # 2 query heads over 1 KV head × 4, float32
    cost = rl.cost_paged_attention([3, 5], 2, 2, 1, 4, torch.float32, page_size=4)
    qo = 2 * 4 * 2 * 2 * 2 * 4
    cached = 2 * 4 * 8 * 1 * 4
    fresh = 2 * 4 * 2 * 2 * 1 * 4
    assert cost.bytes == qo + cached + fresh + 4 * (1 + 2) + 4 * 2 == 660
    assert cost.flops == 4 * 4 * 2 * (2 * (3 + 2) + 2 * (5 + 2)) and cost.flop_kind == "fp32"
    # block-causal, blocks of 4: sequence 3 — query 0 (position 3) sees fresh key 0 only, query 1
    # (position 4) both; sequence 5 — both queries (positions 5, 6) see both fresh keys (7 < 8)
    cost = rl.cost_paged_attention([3, 5], 2, 2, 1, 4, torch.float32, page_size=4, block_size=4)
    assert cost.flops == 4 * 4 * 2 * ((3 + 1) + (3 + 2) + (5 + 2) + (5 + 2))
    assert rl.cost_paged_attention([3, 5], 2, 2, 1, 4, torch.float32, n_new=0, page_size=4).bytes == 660 - fresh


def test_block_sparse_attention_cost():
    # q [1, 2, 4, 4] float32 (2 query blocks of 2), one KV head over 10 keys in blocks of 4 (the last
    # holds 2). Lists: head 0 → [0], [2]; head 1 → [0, 2], [1]; a junk entry past each count.
    q_shape = (1, 2, 4, 4)
    num = torch.tensor([[[1, 1], [2, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 7], [2, 7]], [[0, 2], [1, 7]]]], dtype=torch.int32)
    cost = rl.cost_block_sparse_attention(q_shape, 1, 10, num, idx, q_block_size=2, kv_block_size=4,
                                          dtype=torch.float32)
    pairs = 2 * 4 + 2 * 2 + 2 * (4 + 2) + 2 * 4
    assert cost.flops == 4 * 4 * pairs and cost.flop_kind == "fp32"
    qo = 2 * 4 * 1 * 2 * 4 * 4
    kv = 2 * 4 * (4 + 4 + 2) * 4                  # the union {0, 1, 2} read once for both heads
    assert cost.bytes == qo + kv + 4 * (1 + 1 + 2 + 1) + 4 * 4
    # kv_len 5: block 2 is past it, block 1 holds one position
    cost = rl.cost_block_sparse_attention(q_shape, 1, 10, num, idx, q_block_size=2, kv_block_size=4,
                                          dtype=torch.float32, kv_len=torch.tensor([5]))
    assert cost.flops == 4 * 4 * (2 * 4 + 0 + 2 * 4 + 2 * 1)
    assert cost.bytes == qo + 2 * 4 * (4 + 1) * 4 + 4 * 5 + 4 * 4
    # one list shared by every head through stride 0 is read once; paged adds one table entry a block
    shared = torch.tensor([0, 2, 1], dtype=torch.int64).view(1, 1, 1, 3).expand(1, 2, 2, 3)
    num = torch.full((1, 2, 2), 2, dtype=torch.int32)
    cost = rl.cost_block_sparse_attention(q_shape, 2, 10, num, shared, q_block_size=2, kv_block_size=4,
                                          dtype=torch.float32, paged=True)
    assert cost.bytes == qo + 2 * 2 * 4 * (4 + 2) * 4 + 8 * 2 + 4 * 4 + 4 * 2 * 2


# --- the benchmarks ------------------------------------------------------------------------------------

def _called(node: ast.Call) -> str:
    return node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")


def test_every_bench_case_records_a_roofline():
    """Each test function of bench/test_*.py passes `cost=` to `run`, or calls `record_cost` /
    `no_roofline` (bench/conftest.py)."""
    files = sorted(f for f in os.listdir(BENCH) if f.startswith("test_") and f.endswith(".py"))
    assert len(files) >= 10
    missing = []
    for name in files:
        tree = ast.parse(open(os.path.join(BENCH, name)).read())
        for fn in tree.body:
            if not (isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_")):
                continue
            calls = [n for n in ast.walk(fn) if isinstance(n, ast.Call)]
            if not any((_called(c) == "run" and any(k.arg == "cost" for k in c.keywords))
                       or _called(c) in ("record_cost", "no_roofline") for c in calls):
                missing.append(f"{name}::{fn.name}")
    assert not missing, f"bench cases without a roofline: {missing}"


# One fast case of every kernel benchmark (the end-to-end ones take tens of seconds; the check above
# covers them), run for real: the JSON carries each bound and the report prints it.
FAST_CASES = [
    "bench/test_confidence.py::test_confidence[llada-B1-N32-T0-torch_best]",
    "bench/test_unmask.py::test_unmask[B1-L32-remask]",
    "bench/test_unmask.py::test_unmask_long_rows[1-torch]",
    "bench/test_accept.py::test_accept[16-remask]",
    "bench/test_step.py::test_sampler_step[1-remask]",
    "bench/test_dinfer_kernels.py::test_credit_step[B1-L32-V32768-reference]",
    "bench/test_philox.py::test_seeded_gumbel_noise[B1-V32768-torch_generator]",
    "bench/test_sparse.py::test_sparse_attention[1024-retention 0.1]",
    "bench/test_block_attention.py::test_block_causal_paged_attention[reference]",
    "bench/test_varlen_attention.py::test_varlen_attention[reference]",
    "bench/test_cache.py::test_batch_of_one_shared_prompt_memory[paged]",
]


def test_bench_cases_carry_bounds_and_the_report_prints_them(tmp_path):
    out = tmp_path / "bench.json"
    # Not the interpreter, and not this run's xdist worker settings (pytest-benchmark turns itself off
    # under xdist and would write no JSON).
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "REMASK_TRITON") and not k.startswith(("PYTEST_", "PYTEST_XDIST"))}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           f"--benchmark-json={out}", *FAST_CASES], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert len(data["benchmarks"]) == len(FAST_CASES)
    for b in data["benchmarks"]:
        info = b["extra_info"]
        for gpu in ("a100", "h100"):
            want = bound_us(Cost(info["bytes"], info["flops"], info["flop_kind"]), gpu)
            assert info[f"bound_us_{gpu}"] == pytest.approx(want, rel=1e-6), b["name"]
            assert info[f"limit_{gpu}"] in ("memory", "compute")
        assert info["bytes"] > 0 and info["bound_us_a100"] > info["bound_us_h100"] > 0, b["name"]
    spec = importlib.util.spec_from_file_location("bench_report", os.path.join(BENCH, "report.py"))
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    text, _ = report.report(data)
    section = text[text.index("## Roofline"):]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "×" in line and "case" not in line]
    assert len(rows) == len(FAST_CASES), section
    assert "A100-SXM4-80GB" in section and "H100-SXM5-80GB" in section and "On a CPU the ratios" in section


def test_attention_flops_are_bf16_for_16_bit_inputs_and_fp32_for_float32():
    """The attention kernels' dots: bf16 / fp16 operands as they are, float32 as float32 FMAs
    (input_precision="ieee", no TF32 MMA: the gate's SASS)."""
    for dtype, kind in ((torch.bfloat16, "bf16"), (torch.float16, "bf16"), (torch.float32, "fp32")):
        assert rl.cost_paged_attention([3, 5], 2, 2, 1, 4, dtype, page_size=4).flop_kind == kind
        num = torch.ones(1, 1, 1, dtype=torch.int32)
        idx = torch.zeros(1, 1, 1, 1, dtype=torch.int32)
        assert rl.cost_block_sparse_attention((1, 1, 2, 4), 1, 4, num, idx, q_block_size=2, kv_block_size=4,
                                              dtype=dtype).flop_kind == kind
