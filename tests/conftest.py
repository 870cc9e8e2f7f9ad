"""Shared fixtures: tiny random checkpoints in the official LLaDA / Dream formats, built once per session."""
from __future__ import annotations

import os

# The interpreter runs `tl.dot` as numpy's matmul. OpenBLAS's FMA sgemm kernels (Haswell, Zen: every
# AVX2-only CPU) give rows 6-11 of each 12-row tile another operation order, so under the interpreter a
# row's bits depended on its place in the tile, which the GPU's dot does not (the batch-invariance tests
# failed on AMD EPYC). Its Sandybridge kernels compute every row alike and run on any x86-64 with AVX. Read when
# numpy first loads OpenBLAS, so before anything imports numpy (tests/test_kernel_invariant.py checks it held).
# Set, not defaulted: a machine whose environment names another core type (OPENBLAS_CORETYPE=Haswell was seen
# on one) would otherwise give the interpreter's dot the FMA kernels again.
os.environ["OPENBLAS_CORETYPE"] = "Sandybridge"
# One thread a process: `make test` runs two workers on two cores, and the servers, CLIs and torchrun ranks
# the tests start would otherwise each spin two OpenMP threads against the other worker (this process
# sets torch's count itself, below).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from hypothesis import settings

# Triton kernels are tested on CPU under the interpreter; it must be chosen before triton is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":   # the interpreter's slowest internals, same results, faster
    import interpreter_speedups

    interpreter_speedups.install()

import remask  # noqa: F401  (registers the model classes with transformers)
from helpers import CHECKPOINTS

# Fuzzing (tests/test_fuzz.py, tests/test_fuzz_http.py): "ci" is the default run (50 examples per property,
# derandomized so CI is repeatable: the same examples every run);
# HYPOTHESIS_PROFILE=nightly runs hundreds of random examples per property.
settings.register_profile("ci", max_examples=50, deadline=None, derandomize=True, print_blob=True)
settings.register_profile("nightly", max_examples=400, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

# Tiny shapes make every op small; on 2-core machines OpenMP hand-offs then cost more than the work.
torch.set_num_threads(1)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# The files that take longest, longest first, with their test-seconds in a `make test` profile (2026-11-29, 18:10,
# `--durations=0`, 2 workers). `make test` runs `--dist loadfile --no-loadscope-reorder`: xdist hands whole
# files to the two workers in this order (longest processing time first), so the many short files fill in
# at the end and neither worker runs a long file alone while the other idles (xdist's own order, by test
# count, would start the subprocess-heavy files last). Refresh from a profile run when files grow.
LONGEST_FILES = {
    "tests/test_serve.py": 101, "tests/test_lmeval.py": 92, "tests/test_engine.py": 89,
    "tests/test_kernel_confidence.py": 75, "tests/test_structured_methods.py": 72, "tests/test_zoo.py": 72,
    "tests/test_freedave.py": 63, "tests/test_tensor_parallel.py": 56, "tests/test_structured_own_loops.py": 54,
    "tests/test_kernel_unmask.py": 53, "tests/test_gpu_day.py": 49, "tests/test_ray.py": 49,
    "tests/test_imports.py": 47, "tests/test_klass.py": 46, "tests/test_structured_families.py": 45,
    "tests/test_fuzz.py": 42, "tests/test_freedave_blocks.py": 40, "tests/test_structured_matrix.py": 38,
    "tests/test_structured_http.py": 32, "tests/test_cli.py": 26, "tests/test_zoo_chat.py": 25,
    "tests/test_roofline.py": 23, "tests/test_structured.py": 22, "tests/test_kernel_dinfer.py": 20,
    "tests/test_docs.py": 18, "tests/test_kernel_samplers.py": 17, "tests/test_paged_cache.py": 16,
    "tests/test_portable_random.py": 15, "tests/test_kernel_accept.py": 15, "tests/test_rules_on_blocks.py": 15,
    "tests/test_kernel_invariant.py": 14, "tests/test_sparse.py": 14, "tests/test_kernel_paged.py": 14,
    "tests/test_validation.py": 14, "tests/test_sparse_reference.py": 14, "tests/test_multiblock.py": 13,
    "tests/test_diffusion_gemma.py": 13, "tests/test_bench_structured.py": 13
}


# A reference test with more cases than this runs that many of them, spread evenly over its fixture, in
# `make test`; the rest are marked `slow`: `make test-portable` (CI, after `make test`) and `make test-all` run
# every case. Each fixture is ordered by its settings, so the sample keeps every code path the sweep takes.
SAMPLED_CASES = 12
# Other per-case sweeps over a fixture sampled the same way (they carry the `portable` mark: `make test-portable`
# runs every case).
SAMPLED_SWEEPS = {"tests/test_sparse_reference.py::test_default_tie_rule_departs_only_at_ties"}


def pytest_collection_modifyitems(items):
    """The tests that run reference fixtures' cases carry the `reference` mark (`make test-portable`), the
    cases outside each one's sample (`SAMPLED_CASES`) the `slow` mark; files in the order xdist should hand them
    out: LONGEST_FILES, then the rest by test count (each file's tests keep their order)."""
    from collections import Counter, defaultdict

    from fixture_margins import REFERENCE_TESTS

    cases = defaultdict(list)
    for item in items:
        name = item.nodeid.split("[")[0]
        if name in REFERENCE_TESTS:
            item.add_marker(pytest.mark.reference)
        if name in REFERENCE_TESTS or name in SAMPLED_SWEEPS:
            cases[name].append(item)
    for test in cases.values():
        sample = {round(i * len(test) / SAMPLED_CASES) for i in range(SAMPLED_CASES)}
        for index, item in enumerate(test):
            if index not in sample:
                item.add_marker(pytest.mark.slow)
    files = [item.nodeid.split("::")[0] for item in items]
    count = Counter(files)
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    order = {id(item): (rank.get(path, len(rank)), -count[path], path) for item, path in zip(items, files)}
    items.sort(key=lambda item: order[id(item)])


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every `torch.empty` (kernel outputs and workspaces) comes back filled with NaN, or with
    -7777 for integer tensors, so a value a kernel forgot to write fails loudly."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point():
            out.fill_(float("nan"))
        elif out.dtype in (torch.int8, torch.uint8):
            out.fill_(77 if out.dtype == torch.uint8 else -77)
        elif out.dtype != torch.bool:
            out.fill_(-7777)
        return out

    monkeypatch.setattr(torch, "empty", empty)

@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """`checkpoint_dir(name)` → (path, digest) of a tiny official-format checkpoint, written once."""
    root = tmp_path_factory.mktemp("checkpoints")
    made: dict[str, tuple[str, str]] = {}

    def get(name: str) -> tuple[str, str]:
        if name not in made:
            writer, kwargs = CHECKPOINTS[name]
            path = os.path.join(root, name)
            made[name] = (path, writer(path, **kwargs))
        return made[name]

    return get


@pytest.fixture(scope="session")
def load_model(checkpoint_dir):
    """`load_model(name)` → the checkpoint loaded through `AutoModel` (no trust_remote_code), cached."""
    from transformers import AutoModel

    cache: dict[str, torch.nn.Module] = {}

    def get(name: str) -> torch.nn.Module:
        if name not in cache:
            cache[name] = AutoModel.from_pretrained(checkpoint_dir(name)[0]).eval()
        return cache[name]

    return get




# REMASK_MARGINS_OUT=FILE: every test's decision margins (remask.margins.DecisionMargins), one JSON
# line per test, for tests/fixture_margins.py (which writes them into the reference fixtures).
if os.environ.get("REMASK_MARGINS_OUT"):
    import json

    from remask.margins import DecisionMargins

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(item):
        with DecisionMargins() as margins:
            yield
        # one file per xdist worker (FILE.gw0, …): lines from two processes never interleave
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        with open(os.environ["REMASK_MARGINS_OUT"] + (f".{worker}" if worker else ""), "a") as f:
            f.write(json.dumps({"test": item.nodeid, "decisions": margins.decisions}) + "\n")
