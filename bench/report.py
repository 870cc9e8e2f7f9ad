"""Turn a pytest-benchmark JSON from `bench/` into a markdown report with ratios against the
reference measured in the same run, effective bandwidth and its share of the measured copy
bandwidth, and every case's roofline: its lower bound on an A100 and an H100 (bytes and flops of
one call, `remask.kernels.roofline`) and the measured time over it.

    python bench/report.py bench/results/latest.json            # prints, and writes
    bench/results/<device>-<date>.md and .json beside it
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
from collections import defaultdict


def write_markdown(text: str, out: str | None) -> None:
    """A benchmark script's table: into `out` (folders made as needed), or printed without one."""
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text)
        print(f"written to {out}")
    else:
        print(text)


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e6:.1f} µs" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"


def _fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def report(data: dict) -> tuple[str, str]:
    machine = data.get("machine_info", {})
    benches = data["benchmarks"]
    device = benches[0]["extra_info"].get("device", machine.get("cpu", {}).get("brand_raw", "unknown"))
    date = data.get("datetime", "")[:10]
    versions = benches[0]["extra_info"].get("versions", "")
    lines = [f"# remask kernel benchmarks — {device}", "",
             f"Date {date}; {versions}; command: `make bench` "
             "(pytest-benchmark, median of the rounds; `ratio` = reference median / this median, same run).", ""]
    copy_bw = next((b["extra_info"]["copy_bandwidth"] for b in benches if "copy_bandwidth" in b["extra_info"]), None)
    if copy_bw:
        lines += [f"Measured copy bandwidth (read + write of a large tensor): **{copy_bw / 1e9:.1f} GB/s**.", ""]
    groups: dict[str, dict[str, dict]] = defaultdict(dict)
    for b in benches:
        groups[b["extra_info"].get("group") or b["name"]][b["extra_info"].get("impl", b["name"])] = b
    for kernel in ("confidence", "unmask", "step", "accept", "sparse_attention", "block_attention"):
        rows = [(g, impls) for g, impls in groups.items()
                if next(iter(impls.values()))["extra_info"].get("kernel") == kernel]
        if not rows:
            continue
        bandwidth = kernel in ("confidence", "accept")
        baseline = next(iter(rows[0][1].values()))["extra_info"].get("baseline", "reference")
        header = f"| case | impl | median | ratio vs {baseline} |" + (" GB/s | % of copy bw | peak extra memory* |" if bandwidth else "")
        lines += [f"## {kernel}", "", header, "|" + "---|" * (header.count("|") - 1)]
        for group, impls in sorted(rows, key=lambda r: r[0]):
            ref = impls.get(next(iter(impls.values()))["extra_info"].get("baseline", "reference"))
            for impl, b in sorted(impls.items()):
                median = b["stats"]["median"]
                ratio = f"{ref['stats']['median'] / median:.2f}×" if ref else "—"
                cells = [group, impl, _fmt_time(median), ratio]
                if bandwidth:
                    gbs = b["extra_info"]["bytes"] / median / 1e9
                    share = f"{100 * gbs * 1e9 / copy_bw:.0f}%" if copy_bw else "—"
                    cells += [f"{gbs:.1f}", share, _fmt_bytes(b["extra_info"].get("peak_extra_bytes", 0))]
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if bandwidth:
            lines += ["*GPU: CUDA allocator peak over the call. CPU: growth of the process's peak resident set, a lower "
                      "bound (memory the process already holds and reuses is not counted).", ""]
    lines += _cache_sections(groups)
    lines += _sparse_generate_section(groups)
    lines += _roofline_section(groups)
    slug = re.sub(r"[^a-z0-9]+", "-", device.lower()).strip("-")[:40]
    return "\n".join(lines), f"{slug}-{date}"


def _cache_sections(groups: dict[str, dict[str, dict]]) -> list[str]:
    """End-to-end KV-cache rows (bench/test_cache.py): per-step time and ratio against no cache,
    positions computed, tokens/s; and the K/V bytes of a batch sharing one prompt."""
    lines: list[str] = []
    rows = [(g, impls) for g, impls in groups.items() if next(iter(impls.values()))["extra_info"].get("kernel") == "cache"]
    if rows:
        lines += ["## KV cache, end to end (`remask.generate`, one token per step)", "",
                  "| case | use_cache | median | NFE | per step | step-time ratio vs no cache | positions computed | tokens/s |",
                  "|---|---|---|---|---|---|---|---|"]
        order = {"none": 0, "prefix": 1, "dual": 2, "paged": 3}
        for group, impls in sorted(rows, key=lambda r: r[0]):
            base = impls.get("none")
            for impl, b in sorted(impls.items(), key=lambda kv: order.get(kv[0], 9)):
                info, median = b["extra_info"], b["stats"]["median"]
                per_step = median / info["nfe"]
                ratio = f"{base['stats']['median'] / base['extra_info']['nfe'] / per_step:.2f}×" if base else "—"
                lines.append(f"| {group} | {impl} | {_fmt_time(median)} | {info['nfe']} | {_fmt_time(per_step)} | "
                             f"{ratio} | {info['forward_positions']} | {info['generated'] / median:.1f} |")
        lines.append("")
    rows = [(g, impls) for g, impls in groups.items()
            if next(iter(impls.values()))["extra_info"].get("kernel") == "cache_memory"]
    if rows:
        lines += ["## KV cache memory, batch sharing one prompt", "",
                  "| case | use_cache | K/V bytes held | vs dual | one copy of the prompt's K/V |", "|---|---|---|---|---|"]
        for group, impls in sorted(rows, key=lambda r: r[0]):
            base = impls.get("dual")
            for impl, b in sorted(impls.items()):
                info = b["extra_info"]
                ratio = f"{info['kv_cache_bytes'] / base['extra_info']['kv_cache_bytes']:.3f}" if base else "—"
                lines.append(f"| {group} | {impl} | {_fmt_bytes(info['kv_cache_bytes'])} | {ratio} | "
                             f"{_fmt_bytes(info['prompt_bytes_one_copy'])} |")
        lines.append("")
    return lines


def _sparse_generate_section(groups: dict[str, dict[str, dict]]) -> list[str]:
    """End-to-end Sparse-dLLM retention rows (bench/test_sparse.py): per-step time, ratio vs dense."""
    rows = [(g, impls) for g, impls in groups.items()
            if next(iter(impls.values()))["extra_info"].get("kernel") == "sparse_generate"]
    if not rows:
        return []
    lines = ["## Sparse-dLLM retention, end to end (`remask.generate`)", "",
             "| case | mode | median | NFE | per step | step-time ratio vs dense |", "|---|---|---|---|---|---|"]
    order = {"dense": 0, "retention 1.0": 1, "retention 0.5": 2, "retention 0.3": 3}
    for group, impls in sorted(rows, key=lambda r: r[0]):
        base = impls.get("dense")
        for impl, b in sorted(impls.items(), key=lambda kv: order.get(kv[0], 9)):
            info, median = b["extra_info"], b["stats"]["median"]
            per_step = median / info["nfe"]
            ratio = f"{base['stats']['median'] / base['extra_info']['nfe'] / per_step:.2f}×" if base else "—"
            lines.append(f"| {group} | {impl} | {_fmt_time(median)} | {info['nfe']} | {_fmt_time(per_step)} | {ratio} |")
    return lines + [""]


def _fmt_count(n: float, unit: str) -> str:
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.3g} {prefix}{unit}"
    return f"{n:.0f} {unit}".rstrip()


def _fmt_bound(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.3g} ns"
    return f"{seconds * 1e6:.3g} µs" if seconds < 1e-3 else f"{seconds * 1e3:.3g} ms"


def _fmt_ratio(r: float) -> str:
    return f"{r:.2f}×" if r < 10 else f"{r:.0f}×"


def _roofline_section(groups: dict[str, dict[str, dict]]) -> list[str]:
    """Every case with a roofline (bench/conftest.py `record_cost`): bytes and flops of one call,
    the lower bound on each GPU of `remask.kernels.roofline.GPUS` and measured median / bound."""
    from remask.kernels.roofline import GPUS

    rows = [(g, impl, b) for g, impls in groups.items() for impl, b in impls.items()]
    with_bound = [r for r in rows if "bound_us_a100" in r[2]["extra_info"]]
    without = sorted({(r[2]["extra_info"].get("kernel") or r[0], r[2]["extra_info"]["roofline"]) for r in rows
                      if "bound_us_a100" not in r[2]["extra_info"] and "roofline" in r[2]["extra_info"]})
    if not with_bound and not without:
        return []
    a100, h100 = GPUS["a100"], GPUS["h100"]
    lines = ["## Roofline", "",
             "Lower bound of one call = max(bytes / HBM bandwidth, flops / peak rate of their kind), "
             f"{a100.name}: {a100.hbm_bytes_per_s / 1e12:.3g} TB/s, {a100.flops_per_s['bf16'] / 1e12:.3g} / "
             f"{a100.flops_per_s['tf32'] / 1e12:.3g} / {a100.flops_per_s['fp32'] / 1e12:.3g} TFLOP/s bf16 / tf32 / "
             f"fp32; {h100.name}: {h100.hbm_bytes_per_s / 1e12:.3g} TB/s, {h100.flops_per_s['bf16'] / 1e12:.3g} / "
             f"{h100.flops_per_s['tf32'] / 1e12:.3g} / {h100.flops_per_s['fp32'] / 1e12:.3g} TFLOP/s "
             "(`remask.kernels.roofline`: dense tensor rates, each byte moved once, useful flops only). "
             "`× A100` / `× H100` = measured median / that bound; mem / compute says which side binds. "
             "**On a CPU the ratios run from hundreds to millions, as expected: the bound is a "
             "GPU's.** On a GPU the ratio is the figure that matters (1× = at the roofline; a bound "
             "under ~5 µs is below a launch's overhead).", "",
             "| case | impl | median | bytes | flops | A100 bound | × A100 | H100 bound | × H100 |",
             "|---|---|---|---|---|---|---|---|---|"]
    order = {k: i for i, k in enumerate(("confidence", "unmask", "step", "accept", "dinfer", "philox",
                                          "sparse_attention", "block_attention", "cache", "cache_memory",
                                          "sparse_generate"))}
    with_bound.sort(key=lambda r: (order.get(r[2]["extra_info"].get("kernel"), 99), r[0], r[1]))
    for group, impl, b in with_bound:
        info, median = b["extra_info"], b["stats"]["median"]
        cells = [group, impl, _fmt_time(median), _fmt_count(info["bytes"], "B"),
                 f"{_fmt_count(info['flops'], '')} {info['flop_kind']}"]
        for key in ("a100", "h100"):
            bound = info[f"bound_us_{key}"] * 1e-6
            side = "mem" if info.get(f"limit_{key}") == "memory" else "compute"
            cells += [f"{_fmt_bound(bound)} ({side})", _fmt_ratio(median / bound) if bound > 0 else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for kernel, reason in without:
        lines += [f"No roofline for `{kernel}`: {reason}.", ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("json", help="pytest-benchmark JSON (--benchmark-json) from a run of bench/")
    parser.add_argument("--out-dir", default=None, help="where to write <device>-<date>.md/.json (default: beside the JSON)")
    args = parser.parse_args()
    with open(args.json) as f:
        data = json.load(f)
    text, stem = report(data)
    print(text)
    out_dir = args.out_dir or os.path.dirname(os.path.abspath(args.json))
    with open(os.path.join(out_dir, stem + ".md"), "w") as f:
        f.write(text + "\n")
    target = os.path.join(out_dir, stem + ".json")
    if os.path.abspath(target) != os.path.abspath(args.json):
        shutil.copyfile(args.json, target)


if __name__ == "__main__":
    main()
