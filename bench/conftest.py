"""Benchmark fixtures: the device, its measured copy bandwidth, and a timing helper.

Run with `make bench` (see the README). On a GPU the Triton kernels run compiled; on CPU the
torch paths run (interpreter timings mean nothing, so Triton is never timed there).
"""
from __future__ import annotations

import os
import platform

import pytest
import torch

from remask.kernels import roofline

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# On CPU the float64 reference formulation materialises rows·V·16 bytes; stop the grid at 256 rows.
CPU_MAX_ROWS = 256


def device_name() -> str:
    if ON_GPU:
        return torch.cuda.get_device_name(DEVICE)
    return f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads"


def versions() -> str:
    import transformers
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = "absent"
    return f"torch {torch.__version__}, triton {triton_version}, transformers {transformers.__version__}"


def sync():
    if ON_GPU:
        torch.cuda.synchronize(DEVICE)


def record_cost(benchmark, cost: roofline.Cost) -> None:
    """The roofline of one call (`remask.kernels.roofline`) into the JSON's extra_info: bytes,
    flops, flop_kind, bound_us_a100 / bound_us_h100 and which side binds (limit_a100 / limit_h100);
    `bench/report.py` prints the measured time over each bound."""
    benchmark.extra_info.update(roofline.extra_info(cost))


def forward_cost(model: torch.nn.Module, stats) -> roofline.Cost:
    """The roofline of an end-to-end generate call from its `GenerationStats`: each forward reads
    every weight it multiplies by (the linear layers, and the embedding when it is the tied LM head)
    and spends 2 flops per weight per position computed (`roofline.cost_forward`)."""
    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    if getattr(model.config, "weight_tying", False):
        n += model.get_input_embeddings().weight.numel()
    return roofline.cost_forward(n, stats.forward_positions, stats.nfe, next(model.parameters()).dtype)


def no_roofline(benchmark, reason: str) -> None:
    """Say why a case has no roofline (end-to-end runs with no per-call cost model)."""
    benchmark.extra_info["roofline"] = reason


def run(benchmark, fn, *, rounds: int | None = None, cost: roofline.Cost | None = None, **info):
    """Time `fn` (synchronised) with pytest-benchmark; `info` goes to the JSON's extra_info, and
    `cost` (one call's bytes and flops) its roofline (`record_cost`)."""
    def call():
        out = fn()
        sync()
        return out
    call()  # compile / warm caches outside the timing
    benchmark.extra_info.update(info, device=device_name(), versions=versions())
    if cost is not None:
        record_cost(benchmark, cost)
    if rounds is None:
        rounds = 20 if ON_GPU else 3
    return benchmark.pedantic(call, rounds=rounds, iterations=1, warmup_rounds=1)


def peak_extra_bytes(fn) -> int:
    """Peak memory a call adds over what was allocated before it: CUDA allocator peak on GPU, the
    process's peak resident set (Linux VmHWM, reset through /proc/self/clear_refs) on CPU."""
    if ON_GPU:
        sync()
        before = torch.cuda.memory_allocated(DEVICE)
        torch.cuda.reset_peak_memory_stats(DEVICE)
        fn()
        sync()
        return torch.cuda.max_memory_allocated(DEVICE) - before

    def status(field):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
        raise RuntimeError(f"{field} not in /proc/self/status")

    before = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the peak-RSS high-water mark
    fn()
    return max(0, status("VmHWM") - before)


@pytest.fixture(scope="session")
def copy_bandwidth() -> float:
    """The device's measured copy bandwidth in bytes/s (read + write of a large tensor), the
    yardstick for the kernels' effective bandwidth."""
    n = (1 << 28) if ON_GPU else (1 << 26)  # 1 GiB / 256 MiB of float32
    src = torch.empty(n, dtype=torch.float32, device=DEVICE).fill_(1.0)
    dst = torch.empty_like(src)
    import time
    best = float("inf")
    for _ in range(10 if ON_GPU else 4):
        sync()
        t = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t)
    bandwidth = 2 * src.numel() * src.element_size() / best
    os.environ["REMASK_BENCH_COPY_BW"] = str(bandwidth)
    return bandwidth


def pytest_report_header(config):
    return f"remask bench on {device_name()}: {versions()}"
