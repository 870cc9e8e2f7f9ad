"""Ablations on the shipped tiny models: accuracy against NFE for every decoding strategy.

    python bench/ablate.py --out bench/results/ablation.csv --plot docs/img/ablation.png
    python bench/ablate.py            # a new CSV in bench/results/, its plot beside it (matplotlib)

regenerates the committed results. Without --out the CSV goes to a new file,
bench/results/ablation-YYYYMMDD-HHMMSS.csv (time of the run; -2, -3, ... appended if taken), so a
run never overwrites an existing CSV unless asked to.

Sweeps remask's samplers and their parameters over the held-out problems of
`remask.zoo.tasks` (seed `EVAL_SEED`): LLaDA low-confidence and random remasking over steps and
block_length, Fast-dLLM threshold and factor decoding, sampling temperature, Sparse-dLLM retention
(keep ratio × block), SparseD block masks, APD (the diffusion model drafts, `tiny-ar` verifies) over the mixture weight R
and the lookahead, and the AR model.
Each row of the CSV is one setting: accuracy (exact match; multi-answer tasks by membership),
accuracy per task, NFE per answer (batch 1, exact; for APD the diffusion model's forwards, the
verifier's in `verifier_nfe_per_answer`), tokens/s. Seeded: the same command gives
the same accuracies and NFE (tokens/s depend on the machine). The plot (accuracy vs NFE, one
line per family) is written beside the CSV without a flag when matplotlib is installed
(`.venv/bin/pip install -e '.[plot]'`; `--no-plot` to skip it); without it only the CSV is written.
"""
from __future__ import annotations

import argparse
import importlib.util
import csv
import os
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

import torch

from remask.zoo import load
from remask.zoo.evaluate import GEN_LENGTH, Strategy, evaluate
from remask.zoo.tasks import EVAL_SEED, MULTI_ANSWER_TASKS, TASKS, problems

# Next to this script, not the working directory: the default lands in bench/results wherever it runs.
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
PLOT_INSTALL = ".venv/bin/pip install -e '.[plot]'"


@dataclass(frozen=True)
class Setting:
    family: str
    strategy: Strategy
    params: dict[str, Any]


def sweep(name: str) -> list[Setting]:
    """The settings of a named sweep ("full": everything in docs/ablations.md; "quick": a few)."""
    out: list[Setting] = []

    def add(family: str, label: str, **kw: Any) -> None:
        out.append(Setting(family, Strategy.of(label, **kw), kw))

    if name == "quick":
        add("low_confidence", "low_confidence steps=16", steps=16)
        add("low_confidence", "low_confidence steps=4", steps=4)
        add("threshold", "threshold 0.9", steps=16, threshold=0.9)
        add("apd", "APD R=0.7 lookahead=16", apd=dict(mixture_weight=0.7, kv_window=16, max_lookahead=16))
        add("ar", "AR greedy", ar=True)
        return out
    for block in (16, 8, 4):
        for steps in (16, 8, 4, 2):
            if steps * block >= GEN_LENGTH and steps % (GEN_LENGTH // block) == 0:
                add("low_confidence" if block == 16 else f"low_confidence block={block}",
                    f"low_confidence steps={steps} block={block}", steps=steps, block_length=block)
    add("low_confidence", "low_confidence steps=1", steps=1)
    for steps in (16, 8, 4, 2):
        add("random", f"random steps={steps}", steps=steps, remasking="random")
    for block in (16, 4):
        for threshold in (0.99, 0.9, 0.7, 0.5, 0.3, 0.1):
            add("threshold" if block == 16 else f"threshold block={block}",
                f"threshold {threshold} block={block}", steps=16, block_length=block, threshold=threshold)
    for factor in (0.5, 1.0, 2.0, 4.0, 8.0):
        add("factor", f"factor {factor}", steps=16, factor=factor)
    for temperature in (0.5, 1.0):
        for steps in (16, 4):
            add(f"low_confidence T={temperature}", f"low_confidence T={temperature} steps={steps}",
                steps=steps, temperature=temperature)
    # Sparse-dLLM retention (one token per step): the accuracy cost of keeping fewer keys.
    from remask import SparseConfig
    for block in (16, 8):
        for ratio in (1.0, 0.9, 0.5, 0.3, 0.1):
            add(f"retention block={block}", f"retention {ratio} block={block}", steps=16, block_length=block,
                sparse=SparseConfig(retention_ratio=ratio))
    # SparseD block masks (full forwards; masks fixed after skip_fraction of the steps), blocks of 4.
    for ratio in (0.5, 0.3):
        for skip in (0.2, 0.5):
            add("block_mask", f"block_mask {ratio} skip={skip}", steps=16,
                sparse=SparseConfig(method="block_mask", retention_ratio=ratio, skip_fraction=skip, kv_block_size=4))
    # APD: R from "trust the dLLM" (1) to "demand the verifier's greedy agreement" (0); a shorter
    # lookahead M caps the tokens a round can commit. Coupled Gumbel: the paper's sampling rule.
    for lookahead in (16, 4):
        for R in (1.0, 0.9, 0.7, 0.5, 0.3, 0.0):
            add(f"apd lookahead={lookahead}", f"APD R={R} lookahead={lookahead}",
                apd=dict(mixture_weight=R, kv_window=16, max_lookahead=lookahead))
    for R in (0.9, 0.5):
        add("apd coupled T=1.0", f"APD coupled T=1.0 R={R} lookahead=16", temperature=1.0,
            apd=dict(mixture_weight=R, kv_window=16, max_lookahead=16, coupled_gumbel=True))
    # Decoders II (docs/decoders.md). FreeDave is lossless: its outputs are checked identical to
    # one-token-per-step decoding (low_confidence steps=16, the same cache) in the same run.
    from remask import (CreditDecoding, D2Cache, DKVCache, ElasticCache, FreeDave, HierarchicalDecoding,
                        IterationSmoothing, ThresholdDecoding, VicinityCache, WINO)
    for cache in (None, "dual"):
        for draft_steps in (2, 4, 8):
            add(f"freedave (lossless) cache={cache}", f"FreeDave K={draft_steps} cache={cache}", steps=GEN_LENGTH,
                use_cache=cache, decoder=FreeDave(draft_steps=draft_steps))
    add("low_confidence dual", "low_confidence steps=16 cache=dual", steps=GEN_LENGTH, use_cache="dual")
    for threshold in (0.9, 0.7, 0.5):
        add("dinfer threshold", f"dInfer threshold {threshold}", decoder=ThresholdDecoding(threshold=threshold))
        add("dinfer credit", f"dInfer credit {threshold}", decoder=CreditDecoding(threshold=threshold))
        add("dinfer hierarchy", f"dInfer hierarchy {threshold}", decoder=HierarchicalDecoding(threshold=threshold))
        add("dinfer threshold vicinity", f"dInfer threshold {threshold} vicinity",
            use_cache=VicinityCache(prefix_look=4, after_look=4, warmup_steps=2),
            decoder=ThresholdDecoding(threshold=threshold))
    for threshold in (0.9, 0.7, 0.5):   # iteration smoothing (soft inputs, threshold decaying from 1)
        add("dinfer threshold smoothing", f"dInfer threshold {threshold} smoothing",
            decoder=ThresholdDecoding(threshold=threshold, smoothing=IterationSmoothing()))
    for threshold in (0.9, 0.6, 0.3):
        add("wino", f"WINO {threshold}/0.9", decoder=WINO(threshold=threshold, threshold_back=0.9))
    for reload in (2, 4, 8):
        add("dkv-cache", f"dKV-Cache R={reload} steps=16", steps=GEN_LENGTH, use_cache=DKVCache(cache_reloading_step=reload))
    for reload in (2, 4):   # dKV-Cache-Greedy: its random order, the window of 4 (its CLI's)
        add("dkv-cache greedy", f"dKV-Greedy R={reload} window=4 steps=16", steps=GEN_LENGTH, remasking="random",
            use_cache=DKVCache(cache_reloading_step=reload, variant="greedy", window_size=4))
    for current_k in (8, 4):
        add("d2cache", f"d2Cache current_k={current_k} steps=16", steps=GEN_LENGTH, use_cache=D2Cache(current_k=current_k))
    for gamma in (0.9, 0.5):
        for threshold in (0.9, 0.5):
            add(f"elastic gamma={gamma}", f"Elastic-Cache gamma={gamma} threshold {threshold}",
                use_cache=ElasticCache(window_length=8, threshold=threshold, gamma=gamma))
    # Decoders III (docs/decoders.md): entropy-bounded commits, KL-stable commits, variable length.
    from remask import DAEDAL, EBSampler, KLASS, MultiBlock
    for margin in (0.0, 0.25, 0.5):   # Fast-dLLM++'s Fréchet profile rule, beside threshold / factor
        add("frechet", f"frechet_margin {margin}", steps=16, frechet_margin=margin)
    for threshold in (0.5, 0.1):
        for add_at in (0.5, 0.1):
            add("multiblock", f"MultiBlock entropy<{threshold} add@{add_at} block=4", block_length=4,
                decoder=MultiBlock(threshold=threshold, block_add_threshold=add_at))
    for gamma in (0.01, 0.1, 0.5, 2.0):
        add("eb_sampler", f"EB-Sampler gamma={gamma}", decoder=EBSampler(gamma=gamma))
    for conf in (0.9, 0.6):
        for kl in (0.01, 0.1):
            add("klass", f"KLASS conf={conf} kl={kl} steps=16", steps=GEN_LENGTH,
                decoder=KLASS(conf_threshold=conf, kl_threshold=kl))
    for initial in (4, 8):   # grows towards GEN_LENGTH (the bound) while the end is not confidently EOS
        add("daedal", f"DAEDAL initial={initial}", block_length=4,
            decoder=DAEDAL(initial_gen_length=initial, expansion_factor=4, eos_check_tokens=4))
    add("ar", "AR greedy", ar=True)
    return out


LOSSLESS_BASELINE = {"freedave (lossless) cache=None": "low_confidence steps=16 block=16",
                     "freedave (lossless) cache=dual": "low_confidence steps=16 cache=dual"}


FIELDS = ["family", "setting", "steps", "block_length", "remasking", "threshold", "factor", "temperature",
          "mixture_weight", "max_lookahead", "retention_ratio", "decoder", "cache", "lossless_verified", "accuracy", "multi_answer_accuracy", "nfe_per_answer",
          "verifier_nfe_per_answer", "tokens_per_second"] + [f"acc_{t}" for t in TASKS]


def run(settings: list[Setting], n: int, seed: int, show_progress: bool) -> list[dict[str, Any]]:
    from tqdm.auto import tqdm

    diffusion, _ = load("tiny-llada")
    ar, _ = load("tiny-ar")
    held_out = problems(n, EVAL_SEED)
    rows, outputs = [], {}
    bar = tqdm(total=n * len(settings), disable=not show_progress, file=sys.stderr, desc="ablation")
    for setting in settings:
        s = setting.strategy
        bar.set_postfix_str(s.name)
        r = evaluate(ar if s.ar else diffusion, held_out, s, seed=seed, progress=bar.update, verifier=ar)
        apd = s.options.get("apd", {})
        fixed_schedule = not s.ar and not apd
        multi = [r.per_task[t] for t in MULTI_ANSWER_TASKS if t in r.per_task]
        rows.append({
            "family": setting.family, "setting": s.name, "steps": s.steps or (GEN_LENGTH if fixed_schedule else ""),
            "block_length": s.block_length or (GEN_LENGTH if fixed_schedule else ""),
            "remasking": s.options.get("remasking", "low_confidence") if fixed_schedule else "",
            "threshold": s.options.get("threshold", ""), "factor": s.options.get("factor", ""),
            "temperature": s.options.get("temperature", 0.0),
            "mixture_weight": apd.get("mixture_weight", ""), "max_lookahead": apd.get("max_lookahead", ""),
            "retention_ratio": s.options["sparse"].retention_ratio if "sparse" in s.options else "",
            "decoder": repr(s.options["decoder"]) if s.options.get("decoder") is not None else "",
            "cache": str(s.options["use_cache"]) if s.options.get("use_cache") is not None else "",
            "lossless_verified": "",
            "accuracy": round(r.accuracy, 4), "multi_answer_accuracy": round(sum(multi) / max(1, len(multi)), 4),
            "nfe_per_answer": round(r.nfe_per_answer, 3),
            "verifier_nfe_per_answer": round(r.verifier_nfe_per_answer, 3) if apd else "",
            "tokens_per_second": round(r.tokens_per_second, 1),
            **{f"acc_{t}": round(r.per_task.get(t, float("nan")), 4) for t in TASKS},
        })
        outputs[s.name] = r.outputs
    bar.close()
    for row in rows:   # lossless methods: the same answers as their baseline, verified here
        baseline = LOSSLESS_BASELINE.get(row["family"])
        if baseline is not None and baseline in outputs:
            if outputs[row["setting"]] != outputs[baseline]:
                raise AssertionError(f"{row['setting']} is not identical to {baseline}")
            row["lossless_verified"] = f"identical to {baseline}"
    return rows


def select(settings: list[Setting], families: list[str]) -> list[Setting]:
    """The settings of `families`, in sweep order, with the baseline of each lossless family (its
    answers are checked identical in the same run)."""
    known = list(dict.fromkeys(s.family for s in settings))
    unknown = [f for f in families if f not in known]
    if unknown:
        raise ValueError(f"--only: unknown families {unknown}; the sweep has {known}")
    wanted = set(families)
    baselines = {LOSSLESS_BASELINE[f] for f in families if f in LOSSLESS_BASELINE}
    return [s for s in settings if s.family in wanted or s.strategy.name in baselines]


def read_csv(path: str) -> list[dict[str, Any]]:
    """Rows of an ablation CSV, numbers as numbers (what `write_csv` wrote)."""
    def value(text: str) -> Any:
        if text.lstrip("-").isdigit():
            return int(text)
        try:
            return float(text)
        except ValueError:
            return text
    with open(path, newline="") as f:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(f)]


def merge(old: list[dict[str, Any]], new: list[dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """`old` with `new`'s rows in place of the same settings (added where missing), in sweep order;
    rows of settings no longer in the sweep are dropped."""
    by_name = {r["setting"]: r for r in old}
    by_name.update({r["setting"]: r for r in new})
    return [by_name[name] for name in order if name in by_name]


def create_new(stem: str, ext: str) -> tuple[IO[str], str]:
    """`stem + ext` opened for writing, or `stem-2 + ext`, `stem-3 + ext`, ...: the first that does not
    exist, created exclusively ("x") so that not even a run started in the same second is overwritten."""
    os.makedirs(os.path.dirname(os.path.abspath(stem)), exist_ok=True)
    path, i = stem + ext, 1
    while True:
        try:
            return open(path, "x", newline=""), path
        except FileExistsError:
            i += 1
            path = f"{stem}-{i}{ext}"


def write_csv(rows: list[dict[str, Any]], path: str | None, started: float | None = None) -> str:
    """Writes the CSV to `path` (replacing it), or, if None, to a new
    `bench/results/ablation-YYYYMMDD-HHMMSS.csv` named by `started` (default: now); returns the path."""
    if path is None:
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(started))
        f, path = create_new(os.path.join(RESULTS, f"ablation-{stamp}"), ".csv")
    else:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        f = open(path, "w", newline="")
    with f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    return path


def shown(path: str) -> str:
    """`path` relative to the working directory when it lies under it (bench/results/...), else absolute."""
    rel = os.path.relpath(os.path.abspath(path))
    return path if rel.startswith(os.pardir) else rel


def plot(rows: list[dict[str, Any]], path: str, title: str) -> bool:
    """Accuracy (all tasks, and multi-answer tasks) against NFE per answer; False if no matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed ({PLOT_INSTALL}): no plot written", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 6.4), sharex=True)
    families = list(dict.fromkeys(r["family"] for r in rows))
    colours = plt.get_cmap("tab20").colors   # more families than tab10 has colours
    for i, family in enumerate(families):
        pts = sorted((r for r in rows if r["family"] == family), key=lambda r: r["nfe_per_answer"])
        if family == "ar":
            style = dict(marker="*", markersize=12, linestyle="none")
        elif family.startswith("apd"):   # APD's frontier: drawn thicker, squares
            style = dict(marker="s", markersize=5, linewidth=2.2)
        elif "lossless" in family:       # verified identical to its baseline: diamonds, dashed
            style = dict(marker="D", markersize=5, linestyle="--")
        else:   # more families than colours: the marker changes with each pass over the palette
            style = dict(marker="o^vP"[(i // 20) % 4], markersize=4)
        style["color"] = colours[(2 * i) % 20 + ((2 * i) // 20) % 2]
        for ax, key in zip(axes, ("accuracy", "multi_answer_accuracy")):
            ax.plot([r["nfe_per_answer"] for r in pts], [r[key] for r in pts], label=family, **style)
    for ax, label in zip(axes, ("exact match, all tasks", "multi-answer tasks (colour, animal)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("NFE per answer (16 answer positions; APD: diffusion-model forwards)")
        ax.set_ylabel(label)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=5, frameon=False)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.24, 1, 1))   # the legend below the two panels
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def markdown_table(rows: list[dict[str, Any]]) -> str:
    lines = ["| setting | accuracy | multi-answer | NFE/answer | verifier NFE | tokens/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        verifier = r["verifier_nfe_per_answer"]
        lines.append(f"| {r['setting']} | {r['accuracy']:.1%} | {r['multi_answer_accuracy']:.1%} | "
                     f"{r['nfe_per_answer']:.2f} | {'' if verifier == '' else f'{verifier:.2f}'} | "
                     f"{r['tokens_per_second']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/ablate.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None,
                        help="CSV to write, replaced if it exists (default: a new "
                             "bench/results/ablation-YYYYMMDD-HHMMSS.csv; never an existing file)")
    parser.add_argument("--plot", default=None,
                        help=f"PNG to write (default: beside the CSV, same name, when matplotlib is installed: "
                             f"{PLOT_INSTALL})")
    parser.add_argument("--no-plot", action="store_true", help="write no plot")
    parser.add_argument("--sweep", choices=("full", "quick"), default="full")
    parser.add_argument("--problems", type=int, default=140, help="held-out problems (tasks taken in turn)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the sampling noise (temperature, random remasking)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--markdown", action="store_true", help="also print the table as markdown")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--only", default=None,
                        help="comma-separated families of the sweep to run (a lossless family brings its baseline)")
    parser.add_argument("--merge", default=None,
                        help="a CSV of an earlier run: its rows are kept, those of the settings run now replaced, "
                             "in sweep order (with --only: add or refresh a few families without the whole sweep)")
    args = parser.parse_args(argv)
    if args.problems <= 0:
        parser.error(f"--problems must be positive, got {args.problems}")
    settings = sweep(args.sweep)
    if args.only is not None:
        try:
            settings = select(settings, [f.strip() for f in args.only.split(",") if f.strip()])
        except ValueError as e:
            parser.error(str(e))
    if args.merge is not None and not os.path.isfile(args.merge):
        parser.error(f"--merge: no such CSV {args.merge}")
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()   # transformers' per-load weight bars; ours stay
    t0 = time.time()
    rows = run(settings, args.problems, args.seed, show_progress=not args.no_progress)
    ran = len(rows)
    if args.merge is not None:
        rows = merge(read_csv(args.merge), rows, [s.strategy.name for s in sweep(args.sweep)])
    out = write_csv(rows, args.out, started=t0)
    print(f"{ran} settings × {args.problems} problems in {time.time() - t0:.0f} s; CSV written to {shown(out)}")
    plot_path = args.plot
    if plot_path is None and not args.no_plot and importlib.util.find_spec("matplotlib") is not None:
        plot_path = os.path.splitext(out)[0] + ".png"      # where people look: beside the CSV
    if plot_path and not args.no_plot:
        title = f"tiny-llada / tiny-ar, {args.problems} held-out problems (seed {EVAL_SEED}), sampling seed {args.seed}"
        if plot(rows, plot_path, title):
            print(f"plot → {shown(plot_path)}")
    if args.markdown:
        print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
