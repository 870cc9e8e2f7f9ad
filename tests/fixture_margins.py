"""Decision margins of the reference fixtures: record them, measure the spread between CPUs, write them.

Every reference test marks the start of each fixture case (`helpers.margin_case`); with
REMASK_MARGINS_OUT set, tests/conftest.py records each test's decisions (remask.margins). This
script turns such runs into the per-case `min_margin` of every fixture file
(docs/reference-fixtures.md has the rule):

    python tests/fixture_margins.py record /tmp/m avx512 avx2 default   # one run per ATen capability
    python tests/fixture_margins.py spread /tmp/m/avx512.jsonl /tmp/m/avx2.jsonl /tmp/m/default.jsonl
    python tests/fixture_margins.py apply /tmp/m/avx512.jsonl --drop     # writes min_margin, drops the cases under their bounds

After re-seeding some files, `record ... --tests T...` runs only their tests and `spread ... --only
F...` re-measures only those fixture files (the others keep their entries in SPREAD_FILE).

`spread` compares the runs decision by decision up to where a case's runs went different ways,
sets each fixture file's bound from what it measured, and lists the cases that went another way;
`apply --drop` removes from their fixture files the cases under their file's bound and those that
went another way, whatever their margin.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from helpers import MARGIN_KEYS, case_key  # noqa: E402

from remask.margins import CASE  # noqa: E402

FIXTURES = os.path.join(HERE, "fixtures")

# The smallest margin a kept case may have is its fixture file's bound: FACTOR × the spread measured
# for that method (`spread`: the 99th percentile of how far the relative margins of the same
# decisions moved between ATen's AVX-512 kernels and its AVX2 and scalar `default` ones, over the
# file's cases up to where their runs went different ways), and at least BOUND. A file with no such
# measurement takes FACTOR × the spread over all files. Every case that went another way under a
# capability is dropped whatever its margin. SPREAD_FILE holds the measurement and each file's bound;
# docs/reference-fixtures.md the figures.
BOUND = 1e-5
FACTOR = 10.0
SPREAD_FILE = os.path.join(HERE, "decision_spread.json")
# A change of a margin past this is no rounding: the two runs took different decisions before it
# (a flip, or dInfer's soft inputs drifting), and compare different values from there on.
DIVERGED = 1e-3

# The tests that run the fixture cases: tests/conftest.py marks them `reference`, the set
# `make test-portable` runs under other CPU capabilities.
REFERENCE_TESTS = [
    "tests/test_apd_reference.py::test_reproduces_apd_sample",
    "tests/test_cache.py::test_reproduces_fast_dllm_cache_on_random_checkpoints",
    "tests/test_cache.py::test_reproduces_fast_dllm_cache_on_tiny_llada",
    "tests/test_d2cache.py::test_reproduces_the_official_d2cache",
    "tests/test_daedal.py::test_reproduces_the_official_daedal",
    "tests/test_dinfer.py::test_matches_dinfer",
    "tests/test_dinfer_smoothing.py::test_matches_dinfer",
    "tests/test_dinfer_smoothing.py::test_a_batch_matches_dinfer",
    "tests/test_dkv_dream.py::test_reproduces_the_official_dkv_cache_dream",
    "tests/test_dkv_greedy.py::test_reproduces_the_official_dkv_cache_greedy",
    "tests/test_dkv.py::test_reproduces_the_official_dkv_cache_decode",
    "tests/test_dream_cache.py::test_reproduces_fast_dllm_dream_block_decoder",
    "tests/test_elastic.py::test_reproduces_the_official_elastic_cache",
    "tests/test_frechet.py::test_reproduces_fast_dllm_plus_plus",
    "tests/test_frechet.py::test_a_left_padded_batch_equals_the_reference_rows_alone",
    "tests/test_frechet.py::test_reproduces_fast_dllm_plus_plus_dream",
    "tests/test_fast_dllm_v2.py::test_reproduces_the_official_code_token_for_token",
    "tests/test_klass.py::test_reproduces_the_official_klass",
    "tests/test_llada2.py::test_reproduces_the_official_decoders",
    "tests/test_llada2.py::test_logits_top5_equal_the_official_model",
    "tests/test_multiblock.py::test_reproduces_the_official_generate_multi_block",
    "tests/test_multiblock.py::test_reproduces_the_official_dream_generate_multi_block",
    "tests/test_multiblock.py::test_reproduces_sglangs_full_attn_multi_block",
    "tests/test_prophet.py::test_reproduces_the_official_prophet",
    "tests/test_reference_fixtures.py::test_reproduces_reference",
    "tests/test_sdar.py::test_reproduces_the_official_generate_token_for_token",
    "tests/test_sparse_dream.py::test_reproduces_the_official_dream_samplers",
    "tests/test_sparse_reference.py::test_reproduces_sparse_dllm",
    "tests/test_sparse_reference.py::test_reproduces_sparsed",
    "tests/test_wino.py::test_reproduces_the_official_decoding_wino",
    "tests/test_zoo.py::test_tiny_llada_reproduces_the_official_sampler",
]


def read_run(path: str) -> dict[str, list]:
    """test id → its decisions, from one run's files (FILE and FILE.gw* of xdist workers)."""
    tests: dict[str, list] = {}
    for name in sorted(glob.glob(path) + glob.glob(path + ".gw*")):
        with open(name) as f:
            for line in f:
                row = json.loads(line)
                tests[row["test"]] = row["decisions"]
    return tests


def split_cases(decisions: list) -> dict[str, list]:
    """Case label → its decisions (one label may run several times: all of them)."""
    cases: dict[str, list] = defaultdict(list)
    label = None
    for site, margin in decisions:
        if site == CASE:
            label = margin
            cases[label]   # a case with no decision still counts
        elif label is not None:
            cases[label].append((site, margin))
    return cases


def record(args) -> None:
    os.makedirs(args.dir, exist_ok=True)
    for cap in args.capabilities:
        out = os.path.join(args.dir, f"{cap}.jsonl")
        for old in glob.glob(out) + glob.glob(out + ".gw*"):
            os.remove(old)
        env = dict(os.environ, REMASK_MARGINS_OUT=out, ATEN_CPU_CAPABILITY=cap)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", str(args.workers),
               "--dist", "loadfile", "-m", "reference"] + (args.tests or ["tests"])
        print(cap, subprocess.run(cmd, env=env, cwd=os.path.dirname(HERE)).returncode)


def spread(args) -> None:
    """How far the same decisions' margins moved between the base run and the others, over each
    case up to where its runs went different ways (DIVERGED); written to SPREAD_FILE with the cases
    that went another way (`apply` drops them)."""
    base = read_run(args.runs[0])
    if args.only:   # re-measure these fixture files; the others keep their measurement
        with open(SPREAD_FILE) as f:
            kept = json.load(f)
    changes: dict[str, list] = defaultdict(list)   # fixture file -> changes of its decisions' margins
    flipped, compared = set(), set()
    for other_path in args.runs[1:]:
        other = read_run(other_path)
        for test, decisions in base.items():
            if test not in other:
                continue
            mine, theirs = split_cases(decisions), split_cases(other[test])
            for label, ds in mine.items():
                es = theirs.get(label)
                if es is None:
                    continue
                fixture = label.split(":", 1)[0]
                if args.only and fixture not in args.only:
                    continue
                compared.add(label)
                for (site, a), (other_site, b) in zip(ds, es):
                    if site != other_site or math.isfinite(a) != math.isfinite(b) or abs(a - b) > DIVERGED:
                        flipped.add(label)
                        break
                    if math.isfinite(a):
                        changes[fixture].append(abs(a - b))
                else:
                    if len(es) != len(ds):
                        flipped.add(label)

    def quantile(values, q):
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0
    every = [d for ds in changes.values() for d in ds]
    files = {f: {"decisions": len(ds), "median": quantile(ds, 0.5), "p99": quantile(ds, 0.99), "max": max(ds),
                 "bound": max(BOUND, FACTOR * quantile(ds, 0.99))} for f, ds in sorted(changes.items())}
    if args.only:
        # the named files' entries and flipped cases are replaced; "all" and the totals stay those of
        # the full measurement, plus what this run compared of the named files beyond it
        old_files = {f: kept["files"][f] for f in args.only if f in kept["files"]}
        kept["files"].update(files)
        kept["files"] = dict(sorted(kept["files"].items()))
        kept["flipped"] = sorted({c for c in kept["flipped"] if c.split(":", 1)[0] not in args.only} | flipped)
        kept["remeasured"] = sorted(set(kept.get("remeasured", [])) | set(args.only))
        kept["decisions_compared"] += len(every) - sum(v["decisions"] for v in old_files.values())
        data, files = kept, {f: kept["files"][f] for f in files}
    else:
        data = {"runs": [os.path.basename(r) for r in args.runs], "factor": FACTOR, "least_bound": BOUND,
                "diverged": DIVERGED, "cases_compared": len(compared), "decisions_compared": len(every),
                "all": {"median": quantile(every, 0.5), "p99": quantile(every, 0.99),
                        "bound": max(BOUND, FACTOR * quantile(every, 0.99))},
                "files": files, "flipped": sorted(flipped)}
    with open(SPREAD_FILE, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    for name, v in files.items():
        print(f"{name:36s} {v['decisions']:7d} decisions  median {v['median']:.1e}  p99 {v['p99']:.1e}  "
              f"max {v['max']:.1e}  bound {v['bound']:.1e}")
    print(f"{len(every)} decisions of {len(compared)} cases compared; {len(flipped)} cases went another way")


def file_bound(fixture: str) -> float:
    """The smallest margin a kept case of `fixture` may have (see FACTOR)."""
    with open(SPREAD_FILE) as f:
        data = json.load(f)
    return data["files"].get(fixture, data["all"])["bound"]


def flipped_cases() -> set[str]:
    with open(SPREAD_FILE) as f:
        return set(json.load(f)["flipped"])


def _fixture_cases(data) -> list[dict]:
    """Every case dict of a fixture file (what `margin_case` was given)."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            found.append(node)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(data)
    return found


def apply(args) -> None:
    flipped = flipped_cases()
    per_case: dict[str, list] = defaultdict(list)
    for decisions in read_run(args.run).values():
        for label, ds in split_cases(decisions).items():
            per_case[label].extend(ds)
    by_file: dict[str, dict[str, tuple[float, float]]] = defaultdict(dict)
    for label, ds in per_case.items():
        fixture, key = label.split(":", 1)
        by_file[fixture][key] = (min((m for _, m in ds), default=math.inf), label in flipped)
    for fixture, keys in sorted(by_file.items()):
        path = os.path.join(FIXTURES, fixture)
        with open(path) as f:
            text = f.read()
        data = json.loads(text)
        # one key may stand for several equal dicts (a file read by position repeats an output): all of them
        copies: dict[str, list[dict]] = defaultdict(list)
        for c in _fixture_cases(data):
            copies[case_key(c)].append(c)
        cases = {k: cs[0] for k, cs in copies.items()}
        missing = sorted(set(keys) - set(cases))
        if missing:
            raise SystemExit(f"{fixture}: {len(missing)} recorded cases are not in the file (changed since the run?)")
        low, bound = [], file_bound(fixture)
        for key, (m, went_another_way) in keys.items():
            for case in copies[key]:
                case["min_margin"] = float(f"{m:.4g}") if math.isfinite(m) else None   # None: no decision
            if m < bound or went_another_way:
                low.append(key)
        # a batch case is checked against its rows decoded alone (`<name>_row<i>`): it goes with them
        named = {c["name"]: k for k, c in cases.items() if isinstance(c.get("name"), str)}
        low_names = {cases[k].get("name") for k in low}
        for name, key in named.items():
            if key not in low and any(n.startswith(f"{name}_row") for n in low_names if isinstance(n, str)):
                low.append(key)
        if args.drop and low:
            drop_ids = {id(c) for k in low for c in copies[k]}

            def prune(node, key=None):
                # a list of cases loses them; a list read by position (outputs zipped with the
                # file's prompts) keeps its length, with null where a case was dropped
                if isinstance(node, dict):
                    return {k: prune(v, k) for k, v in node.items()}
                if isinstance(node, list):
                    if key == "cases":
                        return [prune(v) for v in node if id(v) not in drop_ids]
                    return [None if id(v) in drop_ids else prune(v) for v in node]
                return node
            data = prune(data)
        # cases: every case the file has had recorded (those dropped by earlier runs are gone from it)
        dropped_before = data.get("margins", {}).get("dropped", 0)
        data["margins"] = {"rule": "docs/reference-fixtures.md", "bound": bound, "cases": dropped_before + len(keys),
                           "under_bound": len(low),
                           "dropped": dropped_before + (len(low) if args.drop else 0)}
        with open(path, "w") as f:
            # one-line files stay one line; the others get one level of indent per nesting level
            json.dump(data, f, indent=None if "\n" not in text.strip() else 1)
            f.write("\n")
        print(f"{fixture}: {len(keys)} cases, {len(low)} under {bound:.2g} or went another way"
              + (" (dropped)" if args.drop else ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("dir")
    r.add_argument("capabilities", nargs="+")
    r.add_argument("--workers", type=int, default=2)
    r.add_argument("--tests", nargs="+", help="the reference tests to run (default: all of tests/)")
    s = sub.add_parser("spread")
    s.add_argument("runs", nargs="+")
    s.add_argument("--only", nargs="+", help="fixture files to re-measure; the others keep their entries")
    a = sub.add_parser("apply")
    a.add_argument("run")
    a.add_argument("--drop", action="store_true")
    args = parser.parse_args()
    {"record": record, "spread": spread, "apply": apply}[args.cmd](args)


if __name__ == "__main__":
    main()
