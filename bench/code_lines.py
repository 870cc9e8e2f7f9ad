"""Lines of the decoding core by kind: code, docstrings, comments, blank (issue 44's size bar).

    python bench/code_lines.py                       # diffusion/ + remask/engine/ + remask/caches/
    python bench/code_lines.py --rev 6891576         # the same folders at a commit (git show)
    python bench/code_lines.py --limit 7200          # exit 1 when code lines exceed the limit

A line is a *docstring* line when it lies inside a string expression statement (a module, class or
function docstring, or a bare string), a *comment* line when its only token is a comment, *blank*
when it holds only whitespace, and *code* otherwise (a line with code and a trailing comment is code).
"""
from __future__ import annotations

import argparse
import ast
import io
import os
import subprocess
import sys
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("diffusion", "remask/engine", "remask/caches")
KINDS = ("code", "docstrings", "comments", "blank")


def count_source(source: str) -> dict[str, int]:
    """Lines of one module by kind."""
    lines = source.splitlines()
    kind = ["code"] * len(lines)
    for i, line in enumerate(lines):
        if not line.strip():
            kind[i] = "blank"
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i in range(node.lineno - 1, node.end_lineno):
                kind[i] = "docstrings"
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT and not tok.line[:tok.start[1]].strip():
            kind[tok.start[0] - 1] = "comments"
    return {k: kind.count(k) for k in KINDS}


def _files(rev: str | None) -> dict[str, str]:
    if rev is None:
        out = {}
        for folder in FOLDERS:
            for here, _, names in os.walk(os.path.join(ROOT, folder)):
                for name in names:
                    if name.endswith(".py"):
                        path = os.path.join(here, name)
                        out[os.path.relpath(path, ROOT)] = open(path, encoding="utf-8").read()
        return out
    listing = subprocess.run(["git", "-C", ROOT, "ls-tree", "-r", "--name-only", rev, *FOLDERS],
                             check=True, capture_output=True, text=True).stdout.split()
    return {p: subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{p}"], check=True, capture_output=True,
                              text=True).stdout for p in listing if p.endswith(".py")}


def count(rev: str | None = None) -> dict[str, dict[str, int]]:
    """folder → kind → lines, plus a "sum" row."""
    table = {folder: dict.fromkeys(KINDS, 0) for folder in FOLDERS}
    for path, source in _files(rev).items():
        folder = next(f for f in FOLDERS if path.startswith(f + "/"))
        for k, n in count_source(source).items():
            table[folder][k] += n
    table["sum"] = {k: sum(table[f][k] for f in FOLDERS) for k in KINDS}
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rev", help="count at this git revision instead of the work tree")
    parser.add_argument("--limit", type=int, help="fail when the code lines exceed this")
    args = parser.parse_args(argv)
    table = count(args.rev)
    print("| folder | " + " | ".join(KINDS) + " |")
    print("| --- |" + " ---: |" * len(KINDS))
    for folder, row in table.items():
        print(f"| {folder} | " + " | ".join(f"{row[k]:,}" for k in KINDS) + " |")
    if args.limit is not None and table["sum"]["code"] > args.limit:
        print(f"code lines {table['sum']['code']:,} exceed the limit {args.limit:,}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
