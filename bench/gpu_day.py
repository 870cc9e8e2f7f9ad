"""GPU day: the numbers the project lacks, from a lent GPU's few minutes, in one command.

    make gpu-day                                    # = python bench/gpu_day.py (≤ 8 minutes on one H100 / H200)
    python bench/gpu_day.py --out $OUT/gpu-day.md   # on a lent machine (docs/benchmarks.md)
    python bench/gpu_day.py --dry-run               # CPU, tiny shapes: every part's code path (~1 minute)

Each part runs in its own subprocess with its own time box; a part that fails or outruns its box is
reported as such (with what it measured before) and the next one runs. `--budget-s` (default 480)
bounds the whole run: the parts' boxes are scaled down to fit it, and a part with no time left is
reported skipped. `--one-process` runs the parts one after another in this process instead, with no
box (the dry run without an interpreter start per part).

  env           device, driver, CUDA / torch / triton / transformers versions, measured copy bandwidth
  kernel-tests  the kernel tests and the GPU-marked tests on CUDA (Triton compiled, never
                TRITON_INTERPRET), each kernel against its torch reference
  kernel-bench  the kernel benchmarks of bench/ (pytest-benchmark JSON → bench/report.py's tables)
                and each case's measured time over its roofline on this device (kernels/roofline.py)
  engine-llada  LLMEngine tokens/s at 1, 8 and 64 requests for LLaDA's low_confidence rule,
  engine-dream  Fast-dLLM threshold + dual cache, FreeDave + dual cache and dInfer's threshold rule,
                on random bf16 models of LLaDA-8B's / Dream-7B's official configs (built on the
                device, nothing downloaded); model calls and host ms per engine step beside a bare
                forward and the weight-streaming floor
  bitwise       batch invariance: a batch of 16 requests of mixed settings (`batch_invariant=True`,
                16 tokens each), then the first 8 (one per setting) alone: each equals itself in the batch, token for token
  cuda-graphs   `cuda_graphs=True` replays give the eager tokens and bitwise the eager logits
                (LLaDA-8B's official config cut to its first 4 layers: the same shapes per layer)

The report lands in bench/results/gpu-<device>-<date>.md (or `--out`), with `.log` (every part's
output) and `.bench.json` (the kernel benchmarks' JSON) beside it. The dry run writes to a
temporary folder unless `--out` is given.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import glob
import io
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SCRIPT = os.path.abspath(__file__)

# ---------------------------------------------------------------------------------------------
# What runs: the parts, their boxes (seconds on a GPU / in the dry run), the test and bench selections

PARTS: dict[str, tuple[str, float, float]] = {       # name → (what it measures, box on a GPU, box dry)
    "env": ("device, driver, versions, copy bandwidth", 15, 20),
    "kernel-tests": ("kernel tests + GPU-marked tests, Triton compiled", 100, 45),
    "kernel-bench": ("kernel benchmarks, measured / roofline", 120, 30),
    "engine-llada": ("engine tokens/s, random LLaDA-8B (bf16)", 60, 30),
    "engine-dream": ("engine tokens/s, random Dream-7B (bf16)", 60, 30),
    "bitwise": ("batch invariance, alone vs. in a batch of 16", 55, 30),
    "cuda-graphs": ("cuda_graphs=True vs. eager, LLaDA-8B cut to 4 layers", 40, 30),
}
MIN_BOX_S = 3.0          # a part with less time than this left is skipped, not started

KERNEL_TESTS = ("tests/test_kernel_*.py", "tests/test_attention_bf16_mma.py", "tests/test_step_decision.py")
GPU_TESTS = ("tests/test_cuda_graphs.py", "tests/test_sampling_once.py",
             "tests/test_zoo.py::test_load_puts_the_model_on_an_existing_gpu",
             "tests/test_varlen.py::test_varlen_route_on_gpu_gives_each_request_its_tokens_alone_or_among_eight")
# Test files that ask for CUDA but have nothing to run on a GPU (tests/test_gpu_day.py holds the list complete).
NOTHING_FOR_A_GPU = {"tests/test_lmeval.py": "its CUDA branch only skips a CPU-only test"}
# The dry run's CPU form: kernels under the Triton interpreter, and a GPU-marked test (skipped on a CPU).
DRY_TESTS = ("tests/test_step_decision.py", "tests/test_zoo.py::test_load_puts_the_model_on_an_existing_gpu")

BENCH_GROUPS = (("bench/test_confidence.py", "bench/test_unmask.py", "bench/test_step.py", "bench/test_accept.py",
                 "bench/test_dinfer_kernels.py", "bench/test_philox.py"),
                ("bench/test_block_attention.py", "bench/test_varlen_attention.py", "bench/test_sparse.py",
                 "bench/test_cache.py"))
# Seconds of kernel-bench's box kept for the groups after each one (group 2, the attention kernels,
# compiles the most specialisations: on 2026-11-28's H200 it never finished behind group 1).
BENCH_RESERVE_S = (55.0, 0.0)
NOT_BENCHED_HERE = {"bench/test_engine.py": "tiny-llada end to end: the engine parts measure the engine"}
DRY_BENCH = (("bench/test_unmask.py", "bench/test_philox.py", "-k", "(test_unmask and B1-L32) or B1-V32768"),)


@dataclass(frozen=True)
class Sizes:
    """The shapes a run uses: the GPU's (official model configs) or the dry run's (tiny)."""
    requests: tuple[int, ...] = (1, 8, 64)      # issue 47's cells
    prompt: int = 32
    gen: int = 32
    block: int = 32
    bitwise_requests: int = 16
    bitwise_alone: int = 8        # re-run alone: the first 8, one of each setting (--alone)
    bitwise_gen: int = 16
    graph_requests: int = 8
    graph_layers: int | None = 4  # cuda-graphs: the official config's first layers only (None: all)
    tiny: bool = False


FULL = Sizes()
DRY = Sizes(requests=(1, 3), prompt=8, gen=16, block=8, bitwise_requests=8, bitwise_alone=8, bitwise_gen=16,
            graph_requests=8, graph_layers=None, tiny=True)
# The dry run's models: the tiny sizes of remask.models.tiny with a 1000-token vocabulary.
SMALL_VOCAB = {
    "llada": dict(vocab_size=1000, embedding_size=1000, mask_token_id=999, eos_token_id=998, pad_token_id=998),
    "dream": dict(vocab_size=1000, mask_token_id=999, eos_token_id=998, pad_token_id=998, bos_token_id=997)}


def selected_tests(root: str = ROOT) -> list[str]:
    """The kernel tests (globs expanded) and the GPU-marked tests, as pytest arguments."""
    out: list[str] = []
    for pattern in KERNEL_TESTS + GPU_TESTS:
        path = pattern.split("::")[0]
        found = [pattern] if "*" not in path else \
            sorted(os.path.relpath(p, root) for p in glob.glob(os.path.join(root, path)))
        out += [p for p in found if p not in out]
    return out


def missing_tests(selection: list[str], root: str = ROOT) -> list[str]:
    """The entries of a pytest selection whose file, or test function (`file::name`), is not there."""
    missing = []
    for item in selection:
        path, _, name = item.partition("::")
        file = os.path.join(root, path)
        if not os.path.isfile(file) or (name and not re.search(rf"^def {re.escape(name.split('[')[0])}\(",
                                                                open(file).read(), flags=re.M)):
            missing.append(item)
    return missing


# ---------------------------------------------------------------------------------------------
# The time box (standard library only: the parent process never imports torch or touches CUDA)

@dataclass
class Part:
    name: str
    budget_s: float
    command: list[str]
    title: str = ""


@dataclass
class Outcome:
    name: str
    status: str              # "passed", "failed", "timed out", "skipped: <why>"
    seconds: float
    budget_s: float
    note: str = ""
    markdown: str = ""
    data: dict = field(default_factory=dict)
    log: str = ""
    title: str = ""


def run_command(cmd: list[str], timeout: float, log_path: str, env: dict[str, str] | None = None,
                cwd: str = ROOT) -> int | None:
    """Run `cmd` with its output into `log_path`; its exit code, or None when it ran past `timeout`
    seconds (then it and every process it started are killed: it runs in its own process group)."""
    # an xdist worker's variables (this script run from the test suite) would make a pytest child
    # think it is a worker too, and pytest-benchmark then turns its benchmarks off
    env = {k: v for k, v in (os.environ if env is None else env).items() if not k.startswith("PYTEST_XDIST")}
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
        try:
            return proc.wait(timeout=max(0.1, timeout))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
            return None


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def run_part(part: Part, box_s: float, work: str) -> Outcome:
    """One part in its subprocess, stopped after `box_s` seconds. The part writes its result (status,
    note, markdown, data) to $GPU_DAY_RESULT as it goes, so a part stopped at its box still reports
    what it finished; $GPU_DAY_DEADLINE (epoch seconds) tells it when it will be stopped."""
    result_path = os.path.join(work, f"{part.name}.result.json")
    log_path = os.path.join(work, f"{part.name}.log")
    for path in (result_path, log_path):
        if os.path.exists(path):
            os.remove(path)
    start = time.time()
    env = {**os.environ, "GPU_DAY_RESULT": result_path, "GPU_DAY_WORK": work, "PYTHONUNBUFFERED": "1",
           "GPU_DAY_DEADLINE": str(start + box_s - min(5.0, 0.1 * box_s))}
    rc = run_command(part.command, box_s, log_path, env)
    seconds = time.time() - start
    with open(log_path, errors="replace") as f:
        return _outcome(part, box_s, rc, seconds, result_path, f.read())


def run_part_here(part: Part, box_s: float, work: str, args: argparse.Namespace) -> Outcome:
    """One part in this process (`--one-process`), its output captured as its log; no box: `box_s` is
    only reported."""
    result_path = os.path.join(work, f"{part.name}.result.json")
    os.environ.update(GPU_DAY_RESULT=result_path, GPU_DAY_WORK=work)
    start, log = time.time(), io.StringIO()
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        rc = child_main(argparse.Namespace(**{**vars(args), "part": part.name}))
    return _outcome(part, box_s, rc, time.time() - start, result_path, log.getvalue())


def _outcome(part: Part, box_s: float, rc: int | None, seconds: float, result_path: str, log: str) -> Outcome:
    """What a part reported (its result file), checked against how it ended (`rc` None: stopped at its box)."""
    result = _read_json(result_path) or {}
    markdown, data, note = result.get("markdown", ""), result.get("data", {}), result.get("note", "")
    if rc is None:
        status = "timed out"
        note = f"stopped at its {box_s:.0f} s box" + ("; what it finished is below" if markdown else "") \
            + (f" ({note})" if note else "")
    elif result.get("status") not in (None, "running"):
        status = result["status"]
        if rc != 0 and status == "passed":
            status, note = "failed", f"exit code {rc}"
    else:
        status, note = "failed", f"exit code {rc}, no result written" if rc else "exited without a result"
    return Outcome(part.name, status, seconds, box_s, note, markdown, data, log, part.title)


def run_parts(parts: list[Part], budget_s: float, work: str,
              on_outcome: Callable[[list[Outcome]], None] | None = None,
              run: Callable[[Part, float, str], Outcome] = run_part) -> list[Outcome]:
    """Every part in turn (`run`: each in its subprocess), each in min(its box, what is left of `budget_s`);
    one that fails or times out never stops the next. `on_outcome(outcomes so far)` runs after each part."""
    deadline = time.time() + budget_s
    outcomes: list[Outcome] = []
    for part in parts:
        left = deadline - time.time()
        if left < MIN_BOX_S:
            outcome = Outcome(part.name, "skipped: the run's budget is spent", 0.0, part.budget_s, title=part.title)
        else:
            outcome = run(part, min(part.budget_s, left), work)
        outcomes.append(outcome)
        print(f"[gpu-day] {part.name}: {outcome.status} in {outcome.seconds:.1f} s (box {outcome.budget_s:.0f} s)"
              + (f" — {outcome.note}" if outcome.note else ""), flush=True)
        if on_outcome is not None:
            on_outcome(outcomes)
    return outcomes


# ---------------------------------------------------------------------------------------------
# Inside a part's subprocess

class Skip(Exception):
    """A part that cannot run here (no CUDA): reported as "skipped: <message>"."""


class PartResult:
    """What a part reports: status, a one-line note, markdown sections (by key, in order, each
    replaceable as a table grows) and data; rewritten to its JSON file after every change."""

    def __init__(self, path: str) -> None:
        self.path, self.status, self.note = path, "running", ""
        self.sections: dict[str, str] = {}
        self.data: dict[str, Any] = {}
        self.write()

    def section(self, key: str, markdown: str) -> None:
        self.sections[key] = markdown
        self.write()

    def fail(self, note: str) -> None:
        self.status = "failed"
        self.note = "; ".join(filter(None, [self.note, note]))
        self.write()

    def write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dict(status=self.status, note=self.note, markdown="\n\n".join(self.sections.values()),
                           data=self.data), f)
        os.replace(tmp, self.path)


@dataclass
class Context:
    args: argparse.Namespace
    sizes: Sizes
    result: PartResult
    deadline: float           # epoch seconds: the part is stopped soon after
    work: str

    def left(self) -> float:
        return self.deadline - time.time()

    def device(self):
        """The device this part runs on: CUDA, or the CPU in the dry run; Skip where neither."""
        import torch

        if self.args.dry_run:
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise Skip("no CUDA (on a CPU, --dry-run runs every part's CPU form)")
        return torch.device("cuda")


def execute_part(fn: Callable[[Context], None], ctx: Context) -> int:
    """Run one part's function: it passes unless it raised (failed, with the error as the note; the
    traceback goes to the log), raised `Skip`, or marked itself failed."""
    try:
        fn(ctx)
    except Skip as skip:
        ctx.result.status = f"skipped: {skip}"
    except Exception as err:  # noqa: BLE001 - reported, and the next part still runs
        traceback.print_exc()
        ctx.result.fail(f"{type(err).__name__}: {err}".splitlines()[0][:300])
        return 1
    else:
        if ctx.result.status == "running":
            ctx.result.status = "passed"
    ctx.result.write()
    return 1 if ctx.result.status == "failed" else 0


# ---------------------------------------------------------------------------------------------
# Helpers the parts share (torch imported inside: the parent never loads it)

def _md_table(header: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    align = align or "l" * len(header)
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join(" ---: " if a == "r" else " --- " for a in align) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(family: str, device, tiny: bool, layers: int | None = None):
    """A random bf16 model of `family`'s official config (models/official/; the dry run: the tiny
    sizes of remask.models.tiny), built by transformers' Auto classes with remask's registered
    classes directly on `device` (nothing downloaded, no host copy), weights from the model's own
    init at seed 0. `layers`: at most that many transformer layers (every other size unchanged)."""
    import torch
    from transformers import AutoConfig, AutoModel

    import remask  # noqa: F401  (registers the model classes)
    from remask.models import tiny as tiny_models

    if tiny:
        values = {**(tiny_models.LLADA_DEFAULTS if family == "llada" else tiny_models.DREAM_DEFAULTS),
                  **SMALL_VOCAB[family]}
    else:
        values = tiny_models.official_config(family)
    values = {k: v for k, v in values.items() if k not in ("auto_map", "torch_dtype")}
    if layers is not None:
        key = "n_layers" if "n_layers" in values else "num_hidden_layers"   # LLaDA's name, Dream's
        values[key] = min(values[key], layers)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModel.from_config(config, dtype=torch.bfloat16)
    model = model.to(device).eval()
    assert all(p.device.type == device.type for p in model.parameters()), "a parameter left the device"
    return model


def random_prompts(n: int, lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    """`n` prompts of random ordinary ids (below every special id of the configs used here)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    hi = min(100_000, vocab - 100)
    return [torch.randint(0, hi, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


class EventForwardTimer:
    """GPU time inside the model's forwards: CUDA events recorded at each top-level forward's entry
    and exit (forward hooks, no host wait); `total` (seconds) waits once, at the end."""

    def __init__(self, model) -> None:
        import torch

        self.cuda, self.pairs, self._start = torch.cuda, [], None
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post)]

    def _pre(self, *args: Any) -> None:
        self._start = self.cuda.Event(enable_timing=True)
        self._start.record()

    def _post(self, *args: Any) -> None:
        end = self.cuda.Event(enable_timing=True)
        end.record()
        self.pairs.append((self._start, end))

    @property
    def total(self) -> float:
        self.cuda.synchronize()
        return sum(start.elapsed_time(end) for start, end in self.pairs) / 1e3

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


def forward_timer(model, device):
    """Time inside the model's forwards: CUDA events on a GPU, bench/step_overhead.py's
    `ForwardTimer` (wall clock in hooks) on the CPU."""
    if device.type == "cuda":
        return EventForwardTimer(model)
    from step_overhead import ForwardTimer

    return ForwardTimer(model)


def drive(engine, prompts: list[list[int]], params: list, model=None, device=None) -> dict[str, Any]:
    """Submit every request at t = 0 and step `engine` until all finish: wall seconds, engine steps,
    model calls, seconds inside the model's forwards (when `model` is given) and each request's
    generated ids."""
    base_calls = engine.runner.forwards
    timer = forward_timer(model, device) if model is not None else None
    try:
        with AttentionLaunches() as launches:
            _sync(engine.device)
            start = time.perf_counter()
            for i, (ids, p) in enumerate(zip(prompts, params)):
                engine.add_request(str(i), ids, p)
            steps, done = 0, {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[int(out.request_id)] = out.outputs[0]
                steps += 1
            _sync(engine.device)
            wall = time.perf_counter() - start
        inside = timer.total if timer is not None else 0.0
    finally:
        if timer is not None:
            timer.close()
    outs = [done[i] for i in range(len(prompts))]
    errors = [o.error for o in outs if o.error]
    return dict(wall=wall, steps=steps, calls=engine.runner.forwards - base_calls, inside=inside,
                attention_launches=launches.count,
                rows=[o.all_token_ids for o in outs], tokens=sum(len(o.all_token_ids) for o in outs), errors=errors)


ATTENTION_KERNELS = (("remask.kernels.paged", "paged_attention_kernel"),
                     ("remask.kernels.sparse_attention", "block_sparse_attention_kernel"),
                     ("remask.kernels.varlen_attention", "varlen_attention_kernel"))
# torch paths that stand for one launch off CUDA (the dry run): the varlen reference, one call per pack
ATTENTION_FUNCTIONS = (("remask.kernels.varlen_attention", "varlen_attention_torch"),)


class AttentionLaunches:
    """Counts the attention launches of a run (issue 47: per layer per engine step): torch's SDPA
    calls (a torch function mode), every launch of remask's Triton attention kernels (their
    module names proxied while it is open) and, off CUDA, each call of the varlen reference."""

    def __enter__(self):
        import importlib

        import torch
        from torch.overrides import TorchFunctionMode

        counter = self
        self.count, self._patched = 0, []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if func is torch.nn.functional.scaled_dot_product_attention:
                    counter.count += 1
                return func(*args, **(kwargs or {}))

        class Launches:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                counter.count += 1
                return self.kernel[grid]

            def __getattr__(self, name):
                return getattr(self.kernel, name)

        def called(function):
            def count(*args, **kwargs):
                counter.count += 1
                return function(*args, **kwargs)
            return count

        for (module_name, name), wrap in [(kernel, Launches) for kernel in ATTENTION_KERNELS] + [
                (function, called) for function in ATTENTION_FUNCTIONS]:
            module = importlib.import_module(module_name)
            if hasattr(module, name):
                self._patched.append((module, name, getattr(module, name)))
                setattr(module, name, wrap(getattr(module, name)))
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for module, name, kernel in self._patched:
            setattr(module, name, kernel)
        return False


def bare_forward_s(model, rows: int, length: int, device, repeats: int = 5) -> float:
    """Median wall time of one forward `spec.logits(model, x)` of `[rows, length]` random ids, no
    cache, in the engine's batch-invariant context for `rows` rows."""
    import torch

    from remask.kernels.batch_invariant import batch_invariant_linear
    from remask.models.spec import get_spec

    spec = get_spec(model)
    x = torch.tensor(random_prompts(rows, [length], model.config.vocab_size, seed=1), device=device)
    times = []
    with torch.no_grad(), batch_invariant_linear(rows > 1, single_thread=device.type == "cpu" and rows > 1):
        for i in range(repeats + 2):
            _sync(device)
            start = time.perf_counter()
            spec.logits(model, x)
            _sync(device)
            if i >= 2:            # two warm-ups
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def device_key(ctx: Context) -> tuple[str | None, str]:
    """(roofline.GPUS key of this device or None, its name)."""
    import torch

    from remask.kernels.roofline import gpu_for_device

    if ctx.device().type != "cuda":
        return None, f"{platform.machine()} CPU"
    name = torch.cuda.get_device_name()
    return gpu_for_device(name), name


# ---------------------------------------------------------------------------------------------
# The parts

def part_env(ctx: Context) -> None:
    import torch
    import conftest  # bench/conftest.py: device_name, versions, the copy-bandwidth measurement

    device = ctx.device() if ctx.args.dry_run or torch.cuda.is_available() else torch.device("cpu")
    measure_copy = getattr(conftest.copy_bandwidth, "__wrapped__", conftest.copy_bandwidth)
    data: dict[str, Any] = dict(versions=conftest.versions(), python=sys.version.split()[0], cuda=torch.version.cuda,
                                triton_interpret=os.environ.get("TRITON_INTERPRET"))
    if device.type == "cuda":
        from remask.kernels.roofline import GPUS, gpu_for_device

        props = torch.cuda.get_device_properties(device)
        data.update(device=torch.cuda.get_device_name(device), sms=props.multi_processor_count,
                    memory_gib=props.total_memory / 2**30, capability=f"{props.major}.{props.minor}")
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            data["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout.strip() else "?"
        except (OSError, subprocess.TimeoutExpired):
            data["driver"] = "? (no nvidia-smi)"
        key = gpu_for_device(data["device"])
        data["roofline"] = GPUS[key].name if key else None
    else:
        data.update(device=f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} threads",
                    driver="-", roofline=None)
    data["copy_bandwidth"] = measure_copy() if conftest.DEVICE.type == device.type else None
    ctx.result.data.update(data)
    rows = [["device", data["device"]], ["driver", data["driver"]], ["CUDA (torch build)", data["cuda"] or "-"],
            ["versions", data["versions"] + f", Python {data['python']}"],
            ["Triton", "interpreted (TRITON_INTERPRET=1)" if data["triton_interpret"] == "1" or device.type != "cuda"
             else "compiled (TRITON_INTERPRET unset)"]]
    if device.type == "cuda":
        rows += [["SMs / memory / capability", f"{data['sms']} / {data['memory_gib']:.1f} GiB / {data['capability']}"],
                 ["roofline peaks used", data["roofline"] or "none in remask.kernels.roofline.GPUS for this board"]]
    if data["copy_bandwidth"]:
        rows.append(["measured copy bandwidth (read + write, 1 GiB on a GPU)",
                     f"{data['copy_bandwidth'] / 1e9:.1f} GB/s"])
    ctx.result.section("env", _md_table(["", ""], rows))


_STATUSES = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_XDIST_LINE = re.compile(rf"^\[gw\d+\] \[\s*\d+%\] ({_STATUSES}) (\S.*?)\s*$")
_PLAIN_LINE = re.compile(rf"^(\S[^ ]*?\.py::.*?) ({_STATUSES})(?: |$)")


def parse_pytest_verbose(text: str) -> dict[str, str]:
    """node id → outcome from `pytest -v` progress lines, with or without xdist (the last line of
    a test wins: a teardown error follows its PASSED); complete or cut off."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        m = _XDIST_LINE.match(line)
        if m:
            out[m.group(2)] = m.group(1)
            continue
        m = _PLAIN_LINE.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def _pytest_summary(text: str) -> tuple[str, list[str]]:
    """pytest's last summary line and its short-summary FAILED / ERROR lines."""
    final = next((line.strip("= ") for line in reversed(text.splitlines())
                  if re.search(r"\d+ (passed|failed|error|skipped|deselected)|no tests ran", line)), "")
    failures = [line for line in text.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    return final, failures


def part_kernel_tests(ctx: Context) -> None:
    device = ctx.device()
    selection = selected_tests()
    env = dict(os.environ)
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider"]
    log = os.path.join(ctx.work, "kernel-tests.pytest.log")
    open(log, "w").close()
    missing = missing_tests(selection)
    if missing:
        ctx.result.fail(f"the selection names tests that do not exist: {', '.join(missing)}")
    if device.type == "cuda":     # (main() unset TRITON_INTERPRET / REMASK_TRITON: compiled Triton)
        workers = ctx.args.pytest_workers or min(8, os.cpu_count() or 1)
        cmd = base + ["-v", "-rfE", "--tb=short", "-n", str(workers), "--dist", "load", *selection]
        how = f"CUDA, Triton compiled (TRITON_INTERPRET unset), {workers} pytest workers"
    else:
        # The dry run: the CPU form of a few tests under the Triton interpreter (and every path of
        # the GPU selection checked to exist, above).
        env["TRITON_INTERPRET"] = "1"
        cmd = base + ["-v", "-rfE", "--tb=short", *DRY_TESTS]
        how = (f"CPU form (TRITON_INTERPRET=1) of {', '.join(f'`{t}`' for t in DRY_TESTS)}; every path of the "
               "GPU selection checked to exist")
    rc = run_command(cmd, ctx.left() - 2, log, env)
    text = open(log, errors="replace").read()
    print(text)
    outcomes = parse_pytest_verbose(text)
    final, failures = _pytest_summary(text)
    per_file: dict[str, dict[str, int]] = {}
    for node, status in outcomes.items():
        counts = per_file.setdefault(node.split("::")[0], {})
        counts[status] = counts.get(status, 0) + 1
    rows = [[f"`{path}`"] + [counts.get(s, 0) for s in ("PASSED", "FAILED", "ERROR", "SKIPPED")]
            for path, counts in sorted(per_file.items())]
    total = {s: sum(c.get(s, 0) for c in per_file.values()) for s in ("PASSED", "FAILED", "ERROR", "SKIPPED")}
    rows.append(["**all**"] + [f"**{total[s]}**" for s in ("PASSED", "FAILED", "ERROR", "SKIPPED")])
    lines = [f"How: {how}. Selection: {' '.join(f'`{s}`' for s in selection)}.",
             f"pytest: {final or 'no summary (stopped before the end)'}.", "",
             _md_table(["file", "passed", "failed", "errors", "skipped"], rows, "lrrrr")]
    if failures:
        lines += ["", "Failures (pytest's short summary):", "", "```text", *[f[:400] for f in failures[:40]], "```"]
    ctx.result.data.update(counts=total, failed=[n for n, s in outcomes.items() if s in ("FAILED", "ERROR")])
    ctx.result.section("tests", "\n".join(lines))
    if rc is None:
        ctx.result.fail("pytest stopped at the part's box: the counts are the tests that finished")
    elif rc != 0:
        ctx.result.fail(f"pytest exit {rc}: {total['FAILED']} failed, {total['ERROR']} errors")


def _demote(markdown: str, levels: int = 2) -> str:
    """Headings `levels` down (a report nested in a part's section)."""
    return re.sub(r"^(#+) ", lambda m: "#" * levels + m.group(1) + " ", markdown, flags=re.M)


def part_kernel_bench(ctx: Context) -> None:
    device = ctx.device()
    from report import _fmt_bound, _fmt_ratio, _fmt_time, report   # bench/report.py

    from remask.kernels.roofline import GPUS, Cost, bound_us, limit

    groups = BENCH_GROUPS if device.type == "cuda" else DRY_BENCH
    merged: dict[str, Any] | None = None
    for i, group in enumerate(groups):
        if ctx.left() < 5:
            ctx.result.fail(f"bench group {i + 1} ({' '.join(group)}) not started: the part's box")
            break
        out = os.path.join(ctx.work, f"bench-{i}.json")
        log = os.path.join(ctx.work, f"bench-{i}.log")
        reserve = sum(BENCH_RESERVE_S[i:len(groups) - 1]) if device.type == "cuda" else 0.0   # for the later groups
        rc = run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--benchmark-json={out}",
                          *group], max(5.0, ctx.left() - 3 - reserve), log)
        print(open(log, errors="replace").read())
        data = _read_json(out)
        if rc != 0:
            ctx.result.fail(f"bench group {i + 1} ({' '.join(group)}): "
                            + ("stopped at its share of the part's box" if rc is None else f"pytest exit {rc}"))
        if data and data.get("benchmarks"):
            if merged is None:
                merged = data
            else:
                merged["benchmarks"] += data["benchmarks"]
    if merged is None:
        raise RuntimeError("no benchmark finished")
    path = os.path.join(ctx.work, "bench.json")
    with open(path, "w") as f:
        json.dump(merged, f)
    ctx.result.data["bench_json"] = path
    text, _ = report(merged)
    ctx.result.section("report", _demote(text))
    key, name = device_key(ctx)
    if key is None and device.type == "cuda":
        ctx.result.section("device", f"No datasheet peaks for {name} in `remask.kernels.roofline.GPUS`: "
                                     "measured / roofline only against the A100 / H100 bounds above.")
        return
    gpu = GPUS[key or "h100"]
    lead = (f"Measured median over the roofline bound on this device ({gpu.name}: "
            f"{gpu.hbm_bytes_per_s / 1e12:.3g} TB/s, {gpu.flops_per_s['bf16'] / 1e12:.3g} TFLOP/s bf16; "
            "`remask.kernels.roofline`). 1× is the roofline.")
    if device.type != "cuda":
        lead = "**Dry run on a CPU: the ratio is against the H100's bound and means nothing.** " + lead
    rows = []
    by_case = lambda b: tuple(b["extra_info"].get(k, "") for k in ("kernel", "group", "impl"))  # noqa: E731
    for b in sorted(merged["benchmarks"], key=by_case):
        info = b["extra_info"]
        if "bytes" not in info:
            continue
        cost = Cost(info["bytes"], info["flops"], info["flop_kind"])
        bound = bound_us(cost, key or "h100") * 1e-6
        median = b["stats"]["median"]
        rows.append([info.get("group", b["name"]), info.get("impl", ""), _fmt_time(median),
                     f"{_fmt_bound(bound)} ({'mem' if limit(cost, key or 'h100') == 'memory' else 'compute'})",
                     _fmt_ratio(median / bound) if bound > 0 else "—"])
    ctx.result.section("device", "### Measured / roofline on this device\n\n" + lead + "\n\n"
                       + _md_table(["case", "impl", "median", "bound", "measured / bound"], rows, "lllrr"))


def engine_rules(family: str, block: int) -> list[tuple[str, dict[str, Any]]]:
    """The rules of the engine parts, as `SamplingParams` settings for `family` (and `LLMEngine`'s
    `varlen_attention`: `split_engine_settings`)."""
    import remask

    fast = dict(threshold=0.9, use_cache="dual") if family == "llada" else \
        dict(alg="confidence_threshold", threshold=0.9, use_cache="dual")   # Fast-dLLM's Dream block decoder
    return [("LLaDA low_confidence (1 token / step)", dict(block_length=block)),
            ("Fast-dLLM threshold 0.9 + dual cache", dict(block_length=block, **fast)),
            ("FreeDave (4 drafts) + dual cache", dict(block_length=block, use_cache="dual",
                                                      decoder=remask.FreeDave(draft_steps=4))),
            ("dInfer threshold 0.9", dict(block_length=block, decoder=remask.ThresholdDecoding(threshold=0.9))),
            # the same two rules with one varlen attention launch per layer for the whole pack (issue 47)
            ("LLaDA low_confidence, varlen attention", dict(block_length=block, varlen_attention=True)),
            ("Fast-dLLM threshold 0.9 + dual cache, varlen attention",
             dict(block_length=block, varlen_attention=True, **fast))]


def split_engine_settings(kw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A rule's settings → (`LLMEngine` keywords, `SamplingParams` keywords)."""
    engine = {k: kw[k] for k in ("varlen_attention",) if k in kw}
    return engine, {k: v for k, v in kw.items() if k not in engine}


def _engine(model, n: int, **kw):
    from remask.engine import LLMEngine

    return LLMEngine(model, None, max_num_seqs=max(64, n), batch_invariant=True, **kw)


def part_engine(ctx: Context, family: str) -> None:
    device = ctx.device()
    import torch
    import conftest   # bench/conftest.py: forward_cost (the weights one forward reads)
    from report import _fmt_count

    from remask.engine import SamplingParams
    from remask.kernels.roofline import GPUS, bound_us

    sizes = ctx.sizes
    start = time.perf_counter()
    model = build_model(family, device, sizes.tiny)
    built = time.perf_counter() - start
    T = sizes.prompt + sizes.gen
    cost = conftest.forward_cost(model, argparse.Namespace(forward_positions=T, nfe=1))
    key, name = device_key(ctx)
    bare = {n: bare_forward_s(model, n, T, device) for n in sizes.requests}
    copy_bw = ctx.result.data.get("copy_bandwidth")
    lines = [f"Random {family} model of the official config (`models/official/{family}.config.json`"
             + (", tiny sizes: dry run" if sizes.tiny else "") + f"), bf16 on {name}: "
             f"{_fmt_count(sum(p.numel() for p in model.parameters()), '')} parameters, built in {built:.1f} s. "
             f"Prompts of {sizes.prompt} random ids, {sizes.gen} generated tokens in blocks of {sizes.block}, "
             "all requests submitted at t = 0, `batch_invariant=True`, one run each (after a warm-up at 1 request).",
             "",
             f"* Bare forward (`spec.logits`, no cache, `[n, {T}]`): "
             + ", ".join(f"n={n}: {bare[n] * 1e3:.2f} ms" for n in sizes.requests) + "."]
    floor = f"* Weight-streaming floor: {_fmt_count(cost.bytes, 'B')} of linear-layer weights (bf16) read per forward"
    if key is not None:
        floor += (f" / {GPUS[key].hbm_bytes_per_s / 1e12:.3g} TB/s ({GPUS[key].name} datasheet) = "
                  f"**{cost.bytes / GPUS[key].hbm_bytes_per_s * 1e3:.2f} ms**; roofline of one `[1, {T}]` forward "
                  f"(`roofline.cost_forward`) {bound_us(cost, key) / 1e3:.2f} ms")
    else:
        floor += " (no datasheet peaks for this device in `remask.kernels.roofline.GPUS`)"
    if not copy_bw and device.type == "cuda":     # the env part's measurement, else one now
        copy_bw = getattr(conftest.copy_bandwidth, "__wrapped__", conftest.copy_bandwidth)()
    if copy_bw:
        floor += (f"; at the copy bandwidth measured in this run ({copy_bw / 1e9:.0f} GB/s) "
                  f"{cost.bytes / copy_bw * 1e3:.2f} ms")
    lines.append(floor + ".")
    ctx.result.data.update(family=family, bare_forward_s={str(n): s for n, s in bare.items()},
                           weight_bytes=cost.bytes, parameters=sum(p.numel() for p in model.parameters()))
    ctx.result.section("setup", "\n".join(lines))

    rules = engine_rules(family, sizes.block)
    vocab = model.config.vocab_size

    def requests(n: int, kw: dict[str, Any]):
        prompts = random_prompts(n, [sizes.prompt], vocab, seed=n)
        return prompts, [SamplingParams(max_tokens=sizes.gen, seed=i, **split_engine_settings(kw)[1])
                         for i in range(n)]

    with torch.no_grad():
        for _, kw in rules:          # warm-up: kernels compiled, allocator and cuBLAS ready
            drive(_engine(model, 1, **split_engine_settings(kw)[0]), *requests(1, kw))
    rows, cells = [], []
    header = ["rule", "requests", "tokens", "tokens/s", "engine steps", "model calls", "calls / step", "ms / step",
              "in forwards ms / step", "host ms / step", f"bare forward [n, {T}] ms", "attention launches / layer / step",
              "ms / step ÷ weight floor"]
    layers = getattr(model.config, "num_hidden_layers", None) or model.config.n_layers
    floor_ms = cost.bytes / GPUS[key].hbm_bytes_per_s * 1e3 if key is not None else None
    order = {label: i for i, (label, _) in enumerate(rules)}
    for n in sizes.requests:            # every rule at 1 request first: a cut-short run keeps the small ones
        for label, kw in rules:
            if ctx.left() < 3:
                rows.append([label, n, "not run: the part's box"] + [""] * (len(header) - 3))
                ctx.result.note = "some cells not run: the part's box"
            else:
                r = drive(_engine(model, n, **split_engine_settings(kw)[0]), *requests(n, kw), model=model,
                          device=device)
                if r["errors"]:
                    ctx.result.fail(f"{label}, {n} requests: {r['errors'][0]}")
                ms_step, fwd_step = r["wall"] / r["steps"] * 1e3, r["inside"] / r["steps"] * 1e3
                per_layer = r["attention_launches"] / (r["steps"] * layers)
                cells.append(dict(rule=label, requests=n, tokens=r["tokens"], seconds=r["wall"], steps=r["steps"],
                                  calls=r["calls"], inside_s=r["inside"], attention_launches=r["attention_launches"],
                                  layers=layers))
                rows.append([label, n, r["tokens"], f"{r['tokens'] / r['wall']:.1f}", r["steps"], r["calls"],
                             f"{r['calls'] / r['steps']:.2f}", f"{ms_step:.2f}", f"{fwd_step:.2f}",
                             f"{ms_step - fwd_step:.2f}", f"{bare[n] * 1e3:.2f}", f"{per_layer:.2f}",
                             f"{ms_step / floor_ms:.1f}×" if floor_ms else ""])
            ctx.result.data["cells"] = cells
            ctx.result.section("table", _md_table(header, sorted(rows, key=lambda row: (order[row[0]], row[1])),
                                                  "llrrrrrrrrrrr"))


def part_engine_llada(ctx: Context) -> None:
    part_engine(ctx, "llada")


def part_engine_dream(ctx: Context) -> None:
    part_engine(ctx, "dream")


def part_bitwise(ctx: Context) -> None:
    device = ctx.device()
    import torch

    import remask
    from engine import LLADA_MIX   # bench/engine.py's mixed settings (rules, sampling, caches)
    from remask.engine import SamplingParams

    sizes = ctx.sizes
    mix = LLADA_MIX + [("FreeDave + dual cache", dict(block_length=8, use_cache="dual", decoder=remask.FreeDave())),
                       ("dInfer threshold 0.9", dict(block_length=8, decoder=remask.ThresholdDecoding(threshold=0.9)))]
    model = build_model("llada", device, sizes.tiny)
    n = sizes.bitwise_requests
    lengths = [sizes.prompt // 2 + (7 * i) % (sizes.prompt + 1) for i in range(n)]   # mixed prompt lengths
    prompts = random_prompts(n, lengths, model.config.vocab_size, seed=7)
    params = [SamplingParams(max_tokens=sizes.bitwise_gen, seed=i, **mix[i % len(mix)][1]) for i in range(n)]
    with torch.no_grad():
        together = drive(_engine(model, n), prompts, params)
        if together["errors"]:
            ctx.result.fail(f"in the batch: {together['errors'][0]}")
        by_setting: dict[str, list[int]] = {label: [0, 0, 0] for label, _ in mix}   # requests, checked, identical
        for i in range(n):
            by_setting[mix[i % len(mix)][0]][0] += 1
        checked = 0
        ctx.result.section("table", _bitwise_table(by_setting, n, together, sizes.bitwise_gen))
        for i in range(min(n, ctx.args.alone or sizes.bitwise_alone)):
            if ctx.left() < 2:
                ctx.result.note = f"{checked} of {n} requests checked alone before the part's box"
                break
            alone = drive(_engine(model, 1), [prompts[i]], [params[i]])
            counts = by_setting[mix[i % len(mix)][0]]
            counts[1] += 1
            counts[2] += alone["rows"][0] == together["rows"][i]
            checked += 1
            ctx.result.section("table", _bitwise_table(by_setting, n, together, sizes.bitwise_gen))
    same = sum(c[2] for c in by_setting.values())
    ctx.result.data.update(requests=n, checked=checked, identical=same)
    if same != checked:
        ctx.result.fail(f"{checked - same} of {checked} requests differ alone from in the batch")


def _bitwise_table(by_setting: dict[str, list[int]], n: int, together: dict[str, Any], gen: int) -> str:
    rows = [[label, c[0], c[1], f"{c[2]} / {c[1]}" + ("" if c[2] == c[1] else " **DIFFER**")]
            for label, c in by_setting.items()]
    return (f"{n} requests of mixed settings and prompt lengths ({gen} generated tokens each) together in one "
            f"`LLMEngine(batch_invariant=True)` ({together['steps']} engine steps, {together['calls']} model calls), "
            "then the first of them each alone in a fresh engine: the generated ids must be identical.\n\n"
            + _md_table(["setting", "requests", "checked alone", "identical"], rows, "lrrr"))


def part_cuda_graphs(ctx: Context) -> None:
    device = ctx.device()
    import torch

    from engine import DREAM_MIX, UNCACHED_MIX   # bench/engine.py: the settings whose forwards are graphed
    from remask.engine import SamplingParams
    from remask.engine import cuda_graphs as graphing
    from remask.kernels.batch_invariant import batch_invariant_linear
    from remask.models.spec import get_spec

    sizes = ctx.sizes
    if device.type != "cuda":
        sys.path.append(os.path.join(ROOT, "tests"))
        from test_cuda_graphs import FakeBackend   # the stand-in graph of the CPU tests

        graphing.make_backend = lambda device: FakeBackend()
        how = "CPU stand-in graph (`tests/test_cuda_graphs.py`'s `FakeBackend`: replay re-runs the captured body)"
    else:
        how = "`torch.cuda.CUDAGraph` captures (`CudaGraphBackend`)"
    model = build_model("llada", device, sizes.tiny, layers=sizes.graph_layers)
    spec = get_spec(model)
    mix = UNCACHED_MIX + DREAM_MIX
    n = sizes.graph_requests
    prompts = random_prompts(n, [sizes.prompt, sizes.prompt + 4], model.config.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=sizes.gen, seed=i, **mix[i % len(mix)][1]) for i in range(n)]
    with torch.no_grad():
        eager = drive(_engine(model, n), prompts, params)
        graphed_engine = _engine(model, n, cuda_graphs=True)
        first = drive(graphed_engine, prompts, params)     # captures
        second = drive(graphed_engine, prompts, params)    # replays the kept graphs
        graphs = graphed_engine.runner.graphs
        T = sizes.prompt + sizes.gen
        x = torch.tensor(random_prompts(3, [T], model.config.vocab_size, seed=5), device=device)
        context = lambda rows: batch_invariant_linear(rows > 1, single_thread=device.type == "cpu" and rows > 1)  # noqa: E731
        with context(3):
            want = spec.logits(model, x)
        direct = graphing.GraphedForward(graphing.make_backend(device), 8)
        got = direct(x, lambda ids: spec.logits(model, ids), context=context)
        logits_equal = bool(torch.equal(got, want))
    tokens_equal = first["rows"] == eager["rows"] and second["rows"] == eager["rows"]
    errors = eager["errors"] + first["errors"] + second["errors"]
    rows = [["tokens of every request: graphed (first run, second run) = eager", "yes" if tokens_equal else "**NO**"],
            [f"logits of one `[3, {T}]` forward: replay (bucket 4, one padding row) = eager, bitwise",
             "yes" if logits_equal else "**NO**"],
            ["graphs captured / replays in the engine", f"{graphs.captures} / {graphs.replays}"],
            ["eager run (s)", f"{eager['wall']:.3f}"], ["graphed run with captures (s)", f"{first['wall']:.3f}"],
            ["graphed run, replays only (s)", f"{second['wall']:.3f}"]]
    depth = "" if sizes.graph_layers is None else f" LLaDA-8B's config cut to its first {sizes.graph_layers} layers (bf16)."
    ctx.result.section("table", f"How: {how}.{depth} {n} requests (LLaDA's uncached rules and Dream's sampler, "
                                f"prompts of {sizes.prompt} and {sizes.prompt + 4} ids, {sizes.gen} tokens) through "
                                "`LLMEngine(cuda_graphs=False)`, then twice through one `cuda_graphs=True` engine.\n\n"
                       + _md_table(["check", "result"], rows, "lr"))
    ctx.result.data.update(tokens_equal=tokens_equal, logits_equal=logits_equal, captures=graphs.captures,
                           replays=graphs.replays)
    if errors:
        ctx.result.fail(errors[0])
    if not (tokens_equal and logits_equal):
        ctx.result.fail("graph replay differs from eager")
    if graphs.captures == 0 or graphs.replays == 0:
        ctx.result.fail("no forward was graphed")


PART_FUNCTIONS: dict[str, Callable[[Context], None]] = {
    "env": part_env, "kernel-tests": part_kernel_tests, "kernel-bench": part_kernel_bench,
    "engine-llada": part_engine_llada, "engine-dream": part_engine_dream, "bitwise": part_bitwise,
    "cuda-graphs": part_cuda_graphs,
}


# ---------------------------------------------------------------------------------------------
# The report

def render(outcomes: list[Outcome], args: argparse.Namespace, argv: list[str], seconds: float) -> str:
    env = next((o.data for o in outcomes if o.name == "env"), {})
    device = env.get("device", "unknown device")
    date = datetime.date.today().isoformat()
    if args.dry_run:
        title = f"# GPU day — DRY RUN on {device}, {date}"
        banner = ["**Dry run (`--dry-run`): tiny shapes on a CPU, to keep every part's code running. "
                  "No number in this file is a GPU number.**", ""]
    else:
        title, banner = f"# GPU day — {device}, {date}", []
    lines = [title, "", *banner,
             f"Command: `python bench/gpu_day.py {' '.join(argv)}`; budget {args.budget_s:.0f} s, "
             f"took {seconds:.0f} s. "
             "What each part and figure means: docs/benchmarks.md.", ""]
    if env:
        bw = env.get("copy_bandwidth")
        lines += [f"Device {device}; driver {env.get('driver', '?')}; CUDA {env.get('cuda') or '-'}; "
                  f"{env.get('versions', '')}; Python {env.get('python', '?')}"
                  + (f"; measured copy bandwidth {bw / 1e9:.1f} GB/s" if bw else "")
                  + (f"; roofline peaks: {env['roofline']}" if env.get("roofline") else "") + ".", ""]
    lines += ["## Parts", "",
              _md_table(["part", "what", "status", "seconds", "box (s)", "note"],
                        [[o.name, o.title, o.status, f"{o.seconds:.1f}", f"{o.budget_s:.0f}",
                          o.note.replace("|", "\\|")] for o in outcomes], "lllrrl"), ""]
    for o in outcomes:
        if o.name == "env" and o.status == "passed":
            lines += ["## env", "", o.markdown, ""]
            continue
        lines += [f"## {o.name}: {o.title}", "",
                  f"Status: **{o.status}** ({o.seconds:.1f} s of a {o.budget_s:.0f} s box)"
                  + (f" — {o.note}" if o.note else "") + ".", ""]
        if o.markdown:
            lines += [o.markdown, ""]
        if o.status != "passed" and not o.status.startswith("skipped") and o.log:
            tail = [line[:300] for line in o.log.strip().splitlines()[-25:]]
            lines += ["Last lines of its output:", "", "```text", *tail, "```", ""]
    return "\n".join(lines).rstrip() + "\n"


def default_out(args: argparse.Namespace, device: str) -> str:
    date = datetime.date.today().isoformat()
    if args.dry_run:
        return os.path.join(tempfile.gettempdir(), f"gpu-day-dry-run-{date}.md")
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40] or "unknown-device"
    return os.path.join(HERE, "results", f"gpu-{slug}-{date}.md")


def write_outputs(outcomes: list[Outcome], args: argparse.Namespace, argv: list[str], seconds: float) -> str:
    env = next((o.data for o in outcomes if o.name == "env"), {})
    out = args.out or default_out(args, env.get("device", "unknown device"))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    stem = out[:-3] if out.endswith(".md") else out
    with open(out, "w") as f:
        f.write(render(outcomes, args, argv, seconds))
    with open(stem + ".log", "w") as f:
        for o in outcomes:
            f.write(f"===== {o.name}: {o.status} ({o.seconds:.1f} s) =====\n{o.log}\n")
    bench = next((o.data.get("bench_json") for o in outcomes if o.data.get("bench_json")), None)
    if bench and os.path.exists(bench):
        shutil.copyfile(bench, stem + ".bench.json")
    return out


# ---------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/gpu_day.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, every part's code path")
    p.add_argument("--out", default=None, help="the report (default bench/results/gpu-<device>-<date>.md; dry run: "
                                               "a temporary folder); .log and .bench.json go beside it")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole run's budget in seconds (default 480)")
    p.add_argument("--part-budget", action="append", default=[], metavar="PART=SECONDS",
                   help="one part's box (repeatable); boxes are scaled down to fit --budget-s")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)} "
                                                            "(env always runs)")
    p.add_argument("--requests", default=None, help="engine request counts (default 1,8,16; dry run 1,3)")
    p.add_argument("--gen-length", type=int, default=None, help="generated tokens per request (default 32)")
    p.add_argument("--block-length", type=int, default=None, help="block length of the engine rules (default 32)")
    p.add_argument("--alone", type=int, default=None,
                   help="bitwise: how many of the batch's requests to check alone (default 8, one per setting)")
    p.add_argument("--pytest-workers", type=int, default=None,
                   help="kernel tests: pytest-xdist workers (default: the CPUs, at most 8)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: 1 in the dry run)")
    p.add_argument("--one-process", action="store_true",
                   help="every part in this process, one after another, with no time box (a quicker dry run)")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)   # inside a part's subprocess
    return p


def sizes_for(args: argparse.Namespace) -> Sizes:
    sizes = DRY if args.dry_run else FULL
    changes: dict[str, Any] = {}
    if args.requests:
        changes["requests"] = tuple(int(n) for n in args.requests.split(","))
    if args.gen_length:
        changes["gen"] = args.gen_length
    if args.block_length:
        changes["block"] = args.block_length
    return dataclasses.replace(sizes, **changes)


def plan(args: argparse.Namespace, argv: list[str]) -> list[Part]:
    """The parts to run, each with its box: the default for a GPU or the dry run, `--part-budget`
    overrides, all scaled down together when they add up to more than `--budget-s`."""
    names = [name.strip() for name in args.parts.split(",") if name.strip()]
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown parts {unknown}; the parts are {', '.join(PARTS)}")
    names = ["env"] + [name for name in PARTS if name in names and name != "env"]
    boxes = {name: PARTS[name][2 if args.dry_run else 1] for name in names}
    for item in args.part_budget:
        name, _, seconds = item.partition("=")
        if name not in PARTS or not seconds:
            raise SystemExit(f"--part-budget takes PART=SECONDS with PART one of {', '.join(PARTS)}, got {item!r}")
        boxes[name] = float(seconds)
    total = sum(boxes[name] for name in names)
    scale = min(1.0, args.budget_s / total) if total else 1.0
    return [Part(name, boxes[name] * scale, [sys.executable, SCRIPT, *argv, "--part", name], PARTS[name][0])
            for name in names]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if args.part:
        return child_main(args)
    parts = plan(args, argv)
    if not args.dry_run:      # compiled Triton on CUDA tensors in every part, whatever this shell set
        for name in ("TRITON_INTERPRET", "REMASK_TRITON"):
            if os.environ.pop(name, None) is not None:
                print(f"[gpu-day] {name} unset for the parts", flush=True)
    work = tempfile.mkdtemp(prefix="gpu-day-")
    start = time.time()
    out: list[str] = []

    def report(outcomes: list[Outcome]) -> None:
        out[:] = [write_outputs(outcomes, args, argv, time.time() - start)]

    try:
        run = (lambda part, box_s, work: run_part_here(part, box_s, work, args)) if args.one_process else run_part
        outcomes = run_parts(parts, args.budget_s, work, on_outcome=report, run=run)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"[gpu-day] report: {out[0] if out else '(none)'} ({time.time() - start:.0f} s)", flush=True)
    bad = [o.name for o in outcomes if o.status in ("failed", "timed out")]
    if bad:
        print(f"[gpu-day] not passed: {', '.join(bad)}", flush=True)
    return 1 if bad else 0


def child_main(args: argparse.Namespace) -> int:
    """One part, inside its subprocess: bench/ on the path (its helpers are reused), the result
    written as it goes."""
    sys.path.insert(0, HERE)
    if args.threads or args.dry_run:
        import torch

        torch.set_num_threads(args.threads or 1)
    work = os.environ.get("GPU_DAY_WORK") or tempfile.mkdtemp(prefix="gpu-day-part-")
    result = PartResult(os.environ.get("GPU_DAY_RESULT") or os.path.join(work, f"{args.part}.result.json"))
    env_result = _read_json(os.path.join(work, "env.result.json")) or {}
    result.data["copy_bandwidth"] = env_result.get("data", {}).get("copy_bandwidth")   # the env part's measurement
    deadline = float(os.environ.get("GPU_DAY_DEADLINE", time.time() + 3600))
    ctx = Context(args, sizes_for(args), result, deadline, work)
    return execute_part(PART_FUNCTIONS[args.part], ctx)


if __name__ == "__main__":
    sys.exit(main())
