"""constraints.txt with every direct dependency at its lower bound: what `make test-oldest` installs.

    python tests/oldest_constraints.py > .venv-oldest/oldest.txt

pyproject.toml's ranges promise their lower ends; `make test` runs the locked set (constraints.txt),
`make test-latest` the newest the ranges allow, `make test-oldest` this: each direct dependency
(extras included) pinned to its `>=` bound, the rest of the locked set unchanged. Standard library
only (it runs before anything is installed).
"""
from __future__ import annotations

import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lower_bounds() -> dict[str, str]:
    """canonical name → the version of its `>=` bound, for every direct dependency."""
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    lines = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    bounds = {}
    for line in lines:
        spec = line.split(";", 1)[0]
        name = NAME.match(spec).group(1).split("[")[0]
        found = re.search(r">=\s*([0-9][^,\s]*)", spec)
        if found is None:
            raise SystemExit(f"pyproject.toml: {line!r} has no lower bound")
        bounds[canonical(name)] = found.group(1)
    return bounds


def oldest_constraints() -> list[str]:
    bounds = lower_bounds()
    out = []
    with open(os.path.join(ROOT, "constraints.txt")) as f:
        for line in f:
            line = line.rstrip("\n")
            pin = line.split("#", 1)[0].strip()
            if pin and "==" in pin:
                name = canonical(pin.split("==", 1)[0])
                if name in bounds:
                    line = f"{pin.split('==', 1)[0]}=={bounds.pop(name)}"
            out.append(line)
    return out + [f"{name}=={version}" for name, version in sorted(bounds.items())]


if __name__ == "__main__":
    sys.stdout.write("\n".join(oldest_constraints()) + "\n")
