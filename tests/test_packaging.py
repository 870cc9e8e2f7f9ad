"""Installs are reproducible and the dependency ranges are the tested ones: `make test` (CI) installs
constraints.txt (the locked set, inside the ranges); `make test-oldest` every lower bound
(tests/oldest_constraints.py); `make test-latest` the newest the ranges allow. Shipped data folders are declared packages (setuptools warns about them otherwise)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _requirements() -> list[Requirement]:
    project = _pyproject()["project"]
    lines = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        lines += extra
    return [Requirement(line) for line in lines]


def _pins() -> dict[str, Version]:
    pins = {}
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, _, version = line.partition("==")
                assert version, f"constraints.txt: {line!r} is not an exact pin"
                pins[canonicalize_name(name)] = Version(version)
    return pins


def test_every_dependency_is_locked_inside_its_range():
    """Each dependency has a lower bound (what `make test-oldest` runs) and a locked version inside
    its range (what CI runs)."""
    pins = _pins()
    for req in _requirements():
        name = canonicalize_name(req.name)
        assert name in pins, f"{req.name} is a dependency but constraints.txt does not pin it"
        lower = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert lower, f"{req}: give a lower bound (make test-oldest installs it)"
        assert lower[0] <= Version(pins[name].base_version), f"{req}: the locked {pins[name]} is below the range"
        assert req.specifier.contains(pins[name], prereleases=True)


def test_the_oldest_set_is_every_lower_bound():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from oldest_constraints import oldest_constraints

    oldest = {canonicalize_name(line.split("==")[0]): Version(line.split("==")[1])
              for line in oldest_constraints() if "==" in line and not line.startswith("#")}
    for req in _requirements():
        [lower] = [Version(s.version) for s in req.specifier if s.operator == ">="]
        assert oldest[canonicalize_name(req.name)] == lower, req
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    oldest_target = makefile[makefile.index("test-oldest:"):]
    assert "oldest_constraints.py" in oldest_target and "$(PYTEST)" in oldest_target


# The torch releases GPU users pair remask with, and the Triton each one's CUDA build pins
# (`Requires-Dist: triton==3.7.1` / `triton~=3.8.0` / `triton~=3.9.0`): pip must resolve each pair.
TORCH_TRITON = {"2.13.0": "3.7.1", "2.14.1": "3.8.0", "2.15.0": "3.9.0"}


def test_the_ranges_admit_every_recent_torch_with_its_own_triton():
    from remask.kernels.aot import SUPPORTED_TRITON

    reqs = {canonicalize_name(r.name): r for r in _requirements()}
    for torch_version, triton_version in TORCH_TRITON.items():
        assert reqs["torch"].specifier.contains(torch_version), torch_version
        assert reqs["triton"].specifier.contains(triton_version), f"torch {torch_version} pins triton {triton_version}"
    assert set(TORCH_TRITON.values()) == set(SUPPORTED_TRITON)
    docs = open(os.path.join(ROOT, "docs", "kernels.md")).read()
    for torch_version, triton_version in TORCH_TRITON.items():
        assert f"| {torch_version} | {triton_version} |" in docs, "docs/kernels.md: the tested pairs"


def test_transformers_range_has_an_upper_end():
    [req] = [r for r in _requirements() if r.name == "transformers"]
    assert any(s.operator == "<" for s in req.specifier), "transformers' next major release is untested"


def test_the_test_command_installs_the_constraints_and_ci_runs_it():
    makefile = open(os.path.join(ROOT, "Makefile")).read()
    setup = makefile[makefile.index("$(VENV)/.installed:"):makefile.index("demo: setup")]
    assert "constraints.txt" in setup.splitlines()[0]          # a new lock reinstalls
    assert setup.count("-c constraints.txt") == 2               # torch, then the package and its extras
    assert "test-latest:" in makefile and "--upgrade-strategy eager" in makefile and "test-oldest:" in makefile
    assert "make test" in open(os.path.join(ROOT, ".ci", "run")).read()
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "make test " in readme and "make test-latest" in readme


def test_data_folders_are_declared_packages():
    """Every folder under a package root that ships files and has an importable name is in
    `packages` (setuptools' "Package would be ignored" / "absent from packages" warnings)."""
    tool = _pyproject()["tool"]["setuptools"]
    packages, dirs = set(tool["packages"]), tool["package-dir"]
    for package, folder in dirs.items():
        for here, subdirs, files in os.walk(os.path.join(ROOT, folder)):
            subdirs[:] = [d for d in subdirs if d != "__pycache__"]
            relative = os.path.relpath(here, os.path.join(ROOT, folder))
            parts = [] if relative == "." else relative.split(os.sep)
            if not files or not all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", p) for p in parts):
                continue
            name = ".".join([package, *parts])
            if any(name == d or name.startswith(d + ".") and os.path.join(ROOT, dirs[d]) != here
                   for d in dirs if d != package) and name not in dirs:
                continue   # under another root's own entry
            assert name in packages, f"{here} ships files but {name} is not in [tool.setuptools] packages"


def test_building_the_wheel_warns_about_nothing(tmp_path):
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", ROOT, "--no-deps", "--no-build-isolation", "-v",
                           "-w", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "absent from the `packages` configuration" not in done.stdout + done.stderr
