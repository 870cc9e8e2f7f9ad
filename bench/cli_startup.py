"""Wall time of `remask --help` (issue 44's bar: under 0.5 s), best of `--repeats` runs.

    python bench/cli_startup.py --repeats 5

Run it on a quiet machine: the suite checks only that `--help` imports no heavy module
(tests/test_imports.py), since a timed assert fails under load.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    exe = os.path.join(os.path.dirname(sys.executable), "remask")
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        subprocess.run([exe, "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    print(f"remask --help: best {min(times):.3f} s, median {sorted(times)[len(times) // 2]:.3f} s "
          f"over {args.repeats} runs (bar: 0.5 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
