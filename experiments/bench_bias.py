"""``pacmpi bench bias``: separate the ternary estimator's gradient error from pruning's, over
several seeds of the same unshaped fine-tuning; prints the error table and writes the JSON
report and plots to ``--out-dir``.

The same fine-tuning run (``pacmpi bench train``'s workload, unshaped: this is about accuracy
and error, not time) four ways: dense, pruned lossless, dense + ternary, pruned + ternary, the
ternary ones with and without error feedback, plus TernGrad (unbiased, no error feedback), on
several seeds. Every training job runs with ``--bias-probe``
(:class:`pacmpi.experiments.train.BiasProbe`): each step it also all-reduces every rank's local
gradient exactly (one extra float64 all-reduce, benchmark only) and measures the per-coordinate
error of the method's averaged gradient against that exact average on the kept coordinates.

Reported per method (median and range over seeds): final accuracy, the per-step error (median
over steps of the mean and the 99th percentile of ``|error|``, relative to the mean ``|exact|``)
and the bias (per coordinate, the error averaged over the run's steps: its mean ``|.|`` and 99th
percentile), and whether error feedback changes the final accuracy (ranges overlap: a tie).
Writes ``bench_bias.json`` and plots (loss curves, error and bias per method).
"""
import json
import statistics
import sys
from pathlib import Path

from pacmpi.bench import harness
from pacmpi.bench.harness import comma_list, format_spread, overlap, spread
from pacmpi.cli_options import (
    add_cache_dir,
    add_json_file,
    add_merge,
    add_no_plots,
    add_out_dir,
    add_seeds,
    add_timeout,
    command_parser,
)
from pacmpi.experiments.bench_train import (
    FULL,
    add_workload_options,
    derive,
    merge_reports,
    run_benchmark,
)

__all__ = ["DEFAULT_METHODS", "main"]

DEFAULT_METHODS = ("dense", "pactrain-0.8", "pactrain-ternary-0.0",
                   "pactrain-ternary-0.0-noef", "pactrain-ternary-0.8",
                   "pactrain-ternary-0.8-noef", "terngrad")
NOTES = [
    "pacmpi bench bias: FULL workload of pacmpi bench train, unshaped, --bias-probe on every job "
    "(one extra exact float64 all-reduce per step: step times here are not TTA material).",
    "pactrain-ternary-0.0 is dense + ternary (nothing pruned), pactrain-0.8 pruned lossless "
    "(its error is float32 rounding: the negative control), -noef turns error feedback off.",
    "Error per step: e = method's averaged gradient - exact average, on kept coordinates; "
    "relative = mean |e| / mean |exact|. Bias: per coordinate, e averaged over all steps.",
]


def bias_table(report):
    """``{label: row}`` over the seeds of the (unshaped) rate: ``final_accuracy`` and each
    error statistic as :func:`pacmpi.bench.harness.spread`, ``ef_changes_accuracy``
    for a ternary method with an ``-noef`` twin (``False`` when their ranges overlap)."""
    rows = {}
    for rates in report["seed_runs"].values():
        for block in rates.values():
            for label, run in block["runs"].items():
                rows.setdefault(label, []).append(run)
    keys = ("median_relative_error", "median_p99_abs_error", "median_mean_abs_exact",
            "bias_mean_abs", "bias_p99_abs")
    table = {}
    for label, runs in rows.items():
        biases = [run.get("bias") or {} for run in runs]
        row = {"seeds": [run["seed"] for run in runs],
               "final_accuracy": spread([run["final_accuracy"] for run in runs])}
        row.update({key: spread([b.get(key) for b in biases]) for key in keys})
        row["p99_relative_error"] = spread([
            b["median_p99_abs_error"] / b["median_mean_abs_exact"] if b else None
            for b in biases])
        table[label] = row
    for label, row in table.items():
        twin = table.get(label + "-noef")
        if twin:
            row["ef_changes_accuracy"] = not overlap(row["final_accuracy"],
                                                     twin["final_accuracy"])
            twin["ef_changes_accuracy"] = row["ef_changes_accuracy"]
    return table


def _spread_column(title, key, spec, width):
    return title, lambda row: format_spread(row[key], spec, "n/a"), f">{width}"


_COLUMNS = (("method", "label", "<"),
            _spread_column("final accuracy", "final_accuracy", ".4f", 26),
            _spread_column("rel. mean |e|", "median_relative_error", ".3g", 24),
            _spread_column("p99 |e| / mean |exact|", "p99_relative_error", ".3g", 24),
            _spread_column("bias mean |.|", "bias_mean_abs", ".2e", 30),
            _spread_column("bias p99", "bias_p99_abs", ".2e", 30),
            ("EF changes acc.",
             lambda row: {True: "yes", False: "no (tie)"}.get(row.get("ef_changes_accuracy"), ""),
             "<"))


def format_bias(table):
    """The table as text: median [min, max] over seeds."""
    return harness.format_table([dict(row, label=label) for label, row in table.items()],
                                _COLUMNS)


def write_bias_plots(report, table, out_dir, prefix="bench_bias"):
    """Loss curves (per step, median over seeds) and per-method error / bias bars as PNG
    files ``out_dir/<prefix>_<name>.png``; returns ``{name: path}``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {}
    curves = {}
    for rates in report["seed_runs"].values():
        for block in rates.values():
            for label, run in block["runs"].items():
                curves.setdefault(label, []).append(run["loss_curve"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, runs in curves.items():
        steps = min(len(c) for c in runs)
        ax.plot(range(1, steps + 1), [statistics.median(c[i] for c in runs) for i in range(steps)],
                label=label, lw=1.2, ls="--" if label.endswith("-noef") else "-")
    ax.set(xlabel="step", ylabel="training loss (median over seeds)", yscale="log",
           title="loss: dense, pruned, ternary, with / without error feedback")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths["loss"] = str(out_dir / f"{prefix}_loss.png")
    fig.savefig(paths["loss"], dpi=110)
    plt.close(fig)

    labels = list(table)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in ((axes[0], "p99_relative_error",
                            "per-step p99 |error| / mean |exact gradient|"),
                           (axes[1], "bias_p99_abs", "bias: p99 over coordinates of |mean error|")):
        values = [table[m][key] for m in labels]
        medians = [v["median"] or 0.0 for v in values]
        errors = [[(v["median"] or 0.0) - (v["min"] or 0.0) for v in values],
                  [(v["max"] or 0.0) - (v["median"] or 0.0) for v in values]]
        ax.bar(range(len(labels)), medians, yerr=errors, capsize=3,
               color=["tab:gray" if m.endswith("-noef") else "tab:blue" for m in labels])
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
        ax.set(title=title, yscale="symlog", ylabel="median over seeds [range]")
        ax.set_yscale("symlog", linthresh=1e-6)
        ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    paths["error"] = str(out_dir / f"{prefix}_error.png")
    fig.savefig(paths["error"], dpi=110)
    plt.close(fig)
    return paths


def build_parser():
    parser = command_parser("pacmpi bench bias", __doc__)
    parser.add_argument("--methods", type=comma_list(), default=DEFAULT_METHODS, metavar="M,M",
                        help="pacmpi bench train method labels, comma-separated (default "
                        + ", ".join(DEFAULT_METHODS) + ")")
    add_seeds(parser, (0, 1, 2))
    add_workload_options(parser, ("ranks", "epochs", "width", "pretrain_epochs", "hidden"), FULL)
    add_timeout(parser, 1200)
    add_cache_dir(parser)
    add_out_dir(parser)
    add_json_file(parser, "the report", default="OUT_DIR/bench_bias.json")
    add_merge(parser, "runs (other seeds or methods)")
    add_no_plots(parser)
    return parser


def main(argv=None):
    """Entry point of ``pacmpi bench bias``. Exit status 1 when a job failed."""
    args = build_parser().parse_args(argv)
    json_path = Path(args.json or Path(args.out_dir) / "bench_bias.json")
    if args.merge:
        reports = []
        for path in args.merge:
            with open(path) as f:
                reports.append(json.load(f))
        report = derive(merge_reports(reports), reports[0]["config"]["target_fraction"])
    else:
        report = run_benchmark(rates=("none",), methods=args.methods, sweep_ratios=(),
                               seeds=args.seeds, ranks=args.ranks, epochs=args.epochs,
                               width=args.width, hidden=args.hidden,
                               pretrain_epochs=args.pretrain_epochs,
                               train_args=("--bias-probe",), timeout=args.timeout,
                               cache_dir=args.cache_dir, out_dir=args.out_dir,
                               json_path=json_path, plots=False, notes=NOTES)
    report["bias_table"] = bias_table(report)
    if not args.no_plots:
        report["plots"] = write_bias_plots(report, report["bias_table"], args.out_dir,
                                           prefix=json_path.stem)
    report.pop("json", None)
    harness.write_report(json_path, report, "pacmpi bench bias")
    print(format_bias(report["bias_table"]))
    print(f"wrote {json_path}")
    failed = [label for rates in report["seed_runs"].values() for block in rates.values()
              for label in block["failed"]]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
