"""`make gpu-day` (bench/gpu_day.py): the dry run exercises every part on a CPU and reports each; the
time box reports a part that outruns its box or fails and still runs the next; the test and bench
selections name every test that asks for CUDA and every kernel benchmark."""
from __future__ import annotations

import glob
import importlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import gpu_day  # noqa: E402  (bench/gpu_day.py: standard library only at import)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


WRITES_PASSED = _python("import json, os; json.dump({'status': 'passed', 'note': 'fine', 'markdown': 'the table', "
                        "'data': {'x': 1}}, open(os.environ['GPU_DAY_RESULT'], 'w'))")


def test_the_dry_run_reports_every_part_and_the_cpu_parts_pass(tmp_path):
    """`--one-process`: the parts' code as the GPU day runs it, one interpreter start for all of them (the
    subprocess per part and its box: the tests below, on parts that sleep, fail and write)."""
    out = tmp_path / "report.md"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "gpu_day.py"), "--dry-run", "--one-process",
                           "--out", str(out)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    text = out.read_text()
    assert "DRY RUN" in text and "No number in this file is a GPU number" in text
    rows = dict(re.findall(r"^\| ([a-z-]+) \| [^|]+ \| ([^|]+?) \|", text, flags=re.M))
    assert set(gpu_day.PARTS) <= set(rows), rows
    # Every part runs on a CPU in the dry run: its CPU form (Triton interpreter, stand-in graphs) or tiny shapes.
    assert all(rows[name] == "passed" for name in gpu_day.PARTS), rows
    for part in gpu_day.PARTS:
        assert re.search(rf"^## {part}\b", text, flags=re.M), part
    for figure in ("tokens/s", "calls / step", "host ms / step", "Bare forward", "Weight-streaming floor",
                   "attention launches / layer / step", "ms / step ÷ weight floor",
                   "measured / bound", "checked alone", "logits of one", "FreeDave", "dInfer threshold 0.9"):
        assert figure in text, figure
    assert (tmp_path / "report.log").read_text().count("=====") >= 2 * len(gpu_day.PARTS)
    assert json.loads((tmp_path / "report.bench.json").read_text())["benchmarks"]


def test_a_part_past_its_box_times_out_and_one_that_fails_is_reported_and_the_rest_run(tmp_path):
    parts = [gpu_day.Part("sleeps", 1.0, _python("import time; time.sleep(60)")),
             gpu_day.Part("raises", 20.0, _python("raise RuntimeError('boom')")),
             gpu_day.Part("writes", 20.0, WRITES_PASSED)]
    start = time.time()
    outcomes = gpu_day.run_parts(parts, 60, str(tmp_path))
    assert time.time() - start < 30
    sleeps, raises, writes = outcomes
    assert sleeps.status == "timed out" and 0.9 < sleeps.seconds < 10 and "1 s box" in sleeps.note
    assert raises.status == "failed" and "exit code 1" in raises.note and "RuntimeError: boom" in raises.log
    assert writes.status == "passed" and writes.markdown == "the table" and writes.data == {"x": 1}


def test_a_timed_out_part_keeps_what_it_wrote_and_its_children_are_stopped(tmp_path):
    code = ("import json, os, subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "open(os.environ['GPU_DAY_RESULT'] + '.pid', 'w').write(str(child.pid))\n"
            "json.dump({'status': 'running', 'markdown': 'half a table'}, open(os.environ['GPU_DAY_RESULT'], 'w'))\n"
            "time.sleep(60)\n")
    [outcome] = gpu_day.run_parts([gpu_day.Part("half", 2.0, _python(code))], 60, str(tmp_path))
    assert outcome.status == "timed out" and outcome.markdown == "half a table" and "finished is below" in outcome.note
    pid = int((tmp_path / "half.result.json.pid").read_text())
    time.sleep(0.2)
    assert not _running(pid)                 # the part's own subprocess went with it


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


def test_the_run_budget_bounds_every_box_and_skips_parts_with_no_time_left(tmp_path):
    parts = [gpu_day.Part("sleeps", 30.0, _python("import time; time.sleep(60)")),
             gpu_day.Part("writes", 30.0, WRITES_PASSED)]
    start = time.time()
    sleeps, writes = gpu_day.run_parts(parts, 4.0, str(tmp_path))
    assert time.time() - start < 12
    assert sleeps.status == "timed out" and sleeps.budget_s <= 4.0
    assert writes.status.startswith("skipped") and "budget" in writes.status


def test_boxes_scale_down_to_the_budget_and_env_always_runs():
    args = gpu_day.parser().parse_args(["--budget-s", "240", "--parts", "bitwise", "--part-budget", "bitwise=400"])
    parts = gpu_day.plan(args, [])
    assert [p.name for p in parts] == ["env", "bitwise"]
    assert sum(p.budget_s for p in parts) == pytest.approx(240)
    args = gpu_day.parser().parse_args([])
    assert sum(p.budget_s for p in gpu_day.plan(args, [])) <= 450         # the GPU defaults (docs/benchmarks.md)
    boxes = {p.name: p.budget_s for p in gpu_day.plan(args, [])}
    assert boxes["kernel-bench"] > sum(gpu_day.BENCH_RESERVE_S) + 30      # every bench group gets a share
    assert [p.name for p in gpu_day.plan(args, [])] == list(gpu_day.PARTS)
    with pytest.raises(SystemExit):
        gpu_day.plan(gpu_day.parser().parse_args(["--parts", "nope"]), [])


def _ctx(tmp_path):
    args = gpu_day.parser().parse_args(["--dry-run"])
    result = gpu_day.PartResult(str(tmp_path / "part.json"))
    return gpu_day.Context(args, gpu_day.DRY, result, time.time() + 60, str(tmp_path)), tmp_path / "part.json"


def test_execute_part_reports_a_raise_as_failed_keeping_what_was_written(tmp_path):
    ctx, path = _ctx(tmp_path)

    def half_then_raise(ctx):
        ctx.result.section("table", "| a |")
        raise ValueError("the model did not fit")

    assert gpu_day.execute_part(half_then_raise, ctx) == 1
    written = json.loads(path.read_text())
    assert written["status"] == "failed" and "ValueError: the model did not fit" in written["note"]
    assert written["markdown"] == "| a |"


def test_execute_part_passes_skips_and_keeps_a_failure_the_part_marked(tmp_path):
    ctx, path = _ctx(tmp_path)
    assert gpu_day.execute_part(lambda ctx: None, ctx) == 0
    assert json.loads(path.read_text())["status"] == "passed"
    ctx, path = _ctx(tmp_path)

    def no_cuda(ctx):
        raise gpu_day.Skip("no CUDA")

    assert gpu_day.execute_part(no_cuda, ctx) == 0
    assert json.loads(path.read_text())["status"] == "skipped: no CUDA"
    ctx, path = _ctx(tmp_path)
    assert gpu_day.execute_part(lambda ctx: ctx.result.fail("2 of 64 differ"), ctx) == 1
    assert json.loads(path.read_text()) | {"markdown": ""} == \
        {"status": "failed", "note": "2 of 64 differ", "markdown": "", "data": {}}


def test_the_selection_runs_every_test_that_asks_for_cuda():
    selection = gpu_day.selected_tests()
    assert not gpu_day.missing_tests(selection)
    files = {item.split("::")[0] for item in selection}
    assert {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "test_kernel_*.py"))} <= files
    cuda = re.compile(r"cuda\.is_available|from conftest import .*DEVICE")
    asks = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "tests", "test_*.py"))
            if cuda.search(open(p).read())} - {"tests/test_gpu_day.py"}
    assert asks - files == set(gpu_day.NOTHING_FOR_A_GPU), "a test asks for CUDA: add it to GPU_TESTS or say why not"
    assert not gpu_day.missing_tests(list(gpu_day.DRY_TESTS))
    assert gpu_day.missing_tests(["tests/test_zoo.py::no_such_test", "tests/nope.py"]) == \
        ["tests/test_zoo.py::no_such_test", "tests/nope.py"]


def test_the_benchmarks_cover_every_kernel_bench_file():
    benched = {path for group in gpu_day.BENCH_GROUPS for path in group}
    every = {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "bench", "test_*.py"))}
    assert benched | set(gpu_day.NOT_BENCHED_HERE) == every and not benched & set(gpu_day.NOT_BENCHED_HERE)


def test_pytest_verbose_lines_are_parsed_with_and_without_xdist():
    text = "\n".join([
        "tests/test_a.py::test_one ",
        "[gw0] [ 14%] PASSED tests/test_a.py::test_one ",
        "[gw1] [ 28%] FAILED tests/test_b.py::test_two[{'threshold': 0.3}] ",
        "[gw1] [ 42%] SKIPPED tests/test_b.py::test_three ",
        "tests/test_c.py::test_four PASSED                                        [ 57%]",
        "tests/test_c.py::test_five[a b] SKIPPED (needs a CUDA GPU)             [ 71%]",
        "tests/test_c.py::test_four ERROR                                         [ 85%]",
        "FAILED tests/test_b.py::test_two[{'threshold': 0.3}] - RuntimeError: REMASK_TRITON=1 ...",
    ])
    assert gpu_day.parse_pytest_verbose(text) == {
        "tests/test_a.py::test_one": "PASSED", "tests/test_b.py::test_two[{'threshold': 0.3}]": "FAILED",
        "tests/test_b.py::test_three": "SKIPPED", "tests/test_c.py::test_four": "ERROR",
        "tests/test_c.py::test_five[a b]": "SKIPPED"}


def test_roofline_picks_the_device_by_its_cuda_name():
    from remask.kernels.roofline import GPUS, gpu_for_device

    assert gpu_for_device("NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_for_device("NVIDIA H200") == "h200"
    assert gpu_for_device("NVIDIA A100-SXM4-80GB") == "a100"
    for other in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA L4", "NVIDIA A100-PCIE-40GB"):
        assert gpu_for_device(other) is None, other
    assert GPUS["h200"].hbm_bytes_per_s == 4.8e12 and GPUS["h200"].flops_per_s["bf16"] == 989e12


def test_the_gpu_sizes_fit_their_boxes_and_layers_cut_only_the_depth():
    """The sizes that 2026-11-28's H200 run showed to fit: bitwise 16 requests of 16 tokens with 8
    re-run alone (64 of 32 never finished its batch), cuda-graphs on 4 of LLaDA-8B's 32 layers. The
    engine cells are issue 47's 1, 8 and 64 requests, every rule at 1 first (a box cuts the large ones)."""
    full = gpu_day.FULL
    assert (full.bitwise_requests, full.bitwise_alone, full.bitwise_gen, full.graph_layers) == (16, 8, 16, 4)
    assert full.requests == (1, 8, 64) and gpu_day.DRY.bitwise_alone >= gpu_day.DRY.bitwise_requests


def test_the_varlen_call_time_script_runs():
    """bench/varlen_call_time.py, the next GPU session's measurement of the planned call (CPU: the torch paths)."""
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "varlen_call_time.py")], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={k: v for k, v in os.environ.items()
                                                                 if k not in ("TRITON_INTERPRET", "REMASK_TRITON")})
    assert done.returncode == 0, done.stderr[-3000:]
    for piece in ("varlen_attention, tensors", "varlen_attention, plan per step", "four paged_attention calls"):
        assert piece in done.stdout, done.stdout


def test_attention_launches_counts_sdpa_calls_and_triton_attention_launches(monkeypatch):
    import torch
    import torch.nn.functional as F

    from remask.kernels.varlen_attention import varlen_attention

    monkeypatch.setenv("REMASK_TRITON", "1")     # the Triton kernel (the interpreter here)
    q = torch.randn(5, 2, 16)
    with gpu_day.AttentionLaunches() as launches:
        F.scaled_dot_product_attention(q[None], q[None], q[None])
        varlen_attention(q, q, q, torch.tensor([0, 2, 5], dtype=torch.int32))
        varlen_attention(q, q, q, torch.tensor([0, 5], dtype=torch.int32))
    assert launches.count == 3
    module = importlib.import_module("remask.kernels.varlen_attention")   # the package exports the function
    assert type(module.varlen_attention_kernel).__name__ != "Launches"      # put back
    import torch

    model = gpu_day.build_model("llada", torch.device("cpu"), tiny=True, layers=1)
    whole = gpu_day.build_model("llada", torch.device("cpu"), tiny=True)
    assert model.config.n_layers == 1 < whole.config.n_layers
    assert model.config.d_model == whole.config.d_model and model.config.vocab_size == whole.config.vocab_size
