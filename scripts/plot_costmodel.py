"""Predicted PacTrain speedups for 8-1024 ranks x 100 Mbit/s-100 Gbit/s from a fitted cost model.

    python scripts/plot_costmodel.py --fit results/costmodel_fit.json --out-dir results

Writes ``costmodel_predictions.json`` and ``costmodel_speedup.png`` and prints the markdown
tables of docs/cost-model.md: PacTrain's speedups, then every method's step time and the
fastest per rank count and link (the peers at their defaults, flat; their codec not modelled,
so their times are lower bounds). Every rank has its own GPU, 4 per node (``--per-node``), nodes on
a star of per-node links; the speedup is over flat dense fp32 at the same compute per step
(``--compute``, seconds per model, an assumption docs/cost-model.md sources). ``--latency-us``
and ``--link-efficiency`` replace the test bed's fitted a and eta by a cluster's (the bed's are
those of 2 shared cores moving every packet through the kernel).
"""
import argparse
import json
from pathlib import Path

from pacmpi.costmodel import predict

RANKS = (8, 64, 1024)
TABLE_RATES = ("100mbit", "1gbit", "10gbit", "100gbit")
PLOT_RATES = ("100mbit", "250mbit", "500mbit", "1gbit", "2500mbit", "5gbit", "10gbit",
              "25gbit", "50gbit", "100gbit")
VARIANTS = (("pactrain", False), ("pactrain", True), ("pactrain-ternary", False),
            ("pactrain-ternary", True))
DENSITIES = (0.5, 0.2)
# Who wins: every method at its default knobs, PacTrain at density 0.2, flat or hierarchical
# (whichever is faster), against the peers (flat).
CONTENDERS = (("dense", "dense fp32"), ("fp16", "fp16"), ("topk", "TopK 1%"),
              ("dgc", "DGC 0.1%"), ("terngrad", "TernGrad"), ("powersgd", "PowerSGD 4"),
              ("pactrain", "PacTrain 0.2"), ("pactrain-ternary", "PacTrain+ternary 0.2"))


def label(method, hierarchical):
    kind = {"dense": "dense fp32", "pactrain": "lossless"}.get(method, "ternary")
    return kind + (" hier." if hierarchical else " flat")


def grid(fit, models, per_node, rates, codec):
    rows = []
    for model, compute_s in models.items():
        for density in DENSITIES:
            for ranks in RANKS:
                for rate in rates:
                    for method, hierarchical in (("dense", True),) + VARIANTS:
                        rows.append(predict(fit, ranks=ranks, nodes=ranks // per_node, link=rate,
                                            method=method, density=density, model=model,
                                            hierarchical=hierarchical, compute_s=compute_s,
                                            codec=codec))
    return rows


def contenders(fit, models, per_node, codec):
    """Per (model, ranks, rate in TABLE_RATES): each contender's seconds per step (PacTrain's
    best of flat and hierarchical) and the fastest."""
    table = []
    for model, compute_s in models.items():
        for ranks in RANKS:
            for rate in TABLE_RATES:
                common = dict(ranks=ranks, nodes=ranks // per_node, link=rate, model=model,
                              compute_s=compute_s, codec=codec)
                seconds = {}
                for method, name in CONTENDERS:
                    flat = predict(fit, method=method, density=0.2, **common)["seconds"]
                    if method.startswith("pactrain"):
                        flat = min(flat, predict(fit, method=method, density=0.2,
                                                 hierarchical=True, **common)["seconds"])
                    seconds[name] = flat
                table.append({"model": model, "ranks": ranks, "link": rate, "seconds": seconds,
                              "fastest": min(seconds, key=seconds.get)})
    return table


def contenders_markdown(table, model):
    names = [name for _, name in CONTENDERS]
    lines = ["| ranks | link | " + " | ".join(names) + " | fastest |",
             "|---:|---:|" + "---:|" * len(names) + "---|"]
    for row in (r for r in table if r["model"] == model):
        lines.append(f"| {row['ranks']} | {row['link']} | "
                     + " | ".join(f"{row['seconds'][n]:.3f}" for n in names)
                     + f" | {row['fastest']} |")
    return "\n".join(lines)


def markdown(rows, model):
    mine = [r for r in rows if r["model"] == model]
    head = "| ranks | link | dense fp32 s/step | dense fp32 hier. | " + " | ".join(
        f"{label(m, h)} {d}" for d in DENSITIES for m, h in VARIANTS) + " |"
    lines = [head, "|" + "---:|" * (4 + len(DENSITIES) * len(VARIANTS))]
    for ranks in RANKS:
        for rate in TABLE_RATES:
            cells = [r for r in mine if r["ranks"] == ranks and r["link"] == rate]
            if not cells:
                continue
            speedups = [next(r for r in cells if r["density"] == d and r["method"] == m
                             and r["hierarchical"] == h)["speedup_vs_dense"]
                        for d, m, h in [(DENSITIES[0], "dense", True)]
                        + [(d, m, h) for d in DENSITIES for m, h in VARIANTS]]
            lines.append(f"| {ranks} | {rate} | {cells[0]['dense_s']:.3f} | "
                         + " | ".join(f"{s:.2f}" for s in speedups) + " |")
    return "\n".join(lines)


def plot(rows, models, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(models), len(DENSITIES), figsize=(12, 4.5 * len(models)),
                             sharex=True, squeeze=False)
    styles = {8: ":", 64: "--", 1024: "-"}
    for i, model in enumerate(models):
        for j, density in enumerate(DENSITIES):
            ax = axes[i][j]
            for k, (method, hierarchical) in enumerate((("dense", True),) + VARIANTS):
                for ranks in RANKS:
                    mine = [r for r in rows if r["model"] == model and r["density"] == density
                            and r["method"] == method and r["hierarchical"] == hierarchical
                            and r["ranks"] == ranks]
                    ax.plot([r["link"] for r in mine], [r["speedup_vs_dense"] for r in mine],
                            styles[ranks], color=f"C{k}",
                            label=f"{label(method, hierarchical)}, {ranks} ranks")
            ax.axhline(1.0, color="black", linewidth=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{model}, density {density}, compute {models[model]} s/step")
            ax.set_ylabel("speedup over flat dense fp32")
            ax.tick_params(axis="x", labelrotation=45)
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fit", default="results/costmodel_fit.json")
    parser.add_argument("--out-dir", default="results")
    parser.add_argument("--compute", default="resnet152=0.329,bert-base=0.216",
                        help="MODEL=SECONDS of compute per step, comma-separated")
    parser.add_argument("--per-node", type=int, default=4, help="GPUs (ranks) per node")
    parser.add_argument("--latency-us", type=float, default=None,
                        help="replace the fitted per-ring-step latency a (microseconds)")
    parser.add_argument("--link-efficiency", type=float, default=None, metavar="ETA",
                        help="replace the fitted share of the nominal link rate (eta, 0-1]")
    parser.add_argument("--codec", action="store_true",
                        help="keep the fitted (this host's CPU) codec costs; default: free, as "
                             "for GPU kernels")
    args = parser.parse_args(argv)
    fit = json.loads(Path(args.fit).read_text())
    if args.latency_us is not None:
        if args.latency_us < 0:
            parser.error(f"--latency-us must be >= 0, got {args.latency_us}")
        fit["latency_s"] = args.latency_us * 1e-6
    if args.link_efficiency is not None:
        if not 0 < args.link_efficiency <= 1:
            parser.error(f"--link-efficiency must be in (0, 1], got {args.link_efficiency}")
        fit["link_efficiency"] = args.link_efficiency
    models = {name: float(seconds) for name, seconds in
              (item.split("=") for item in args.compute.split(","))}
    rows = grid(fit, models, args.per_node, PLOT_RATES, args.codec)
    table = contenders(fit, models, args.per_node, args.codec)
    out = Path(args.out_dir)
    settings = {"fit": args.fit, "latency_s": fit["latency_s"],
                "link_efficiency": fit["link_efficiency"], "intra_Bps": fit["intra_Bps"],
                "per_node": args.per_node, "compute_s": models, "codec": args.codec}
    (out / "costmodel_predictions.json").write_text(json.dumps(
        {"settings": settings, "rows": rows, "contenders": table}, indent=1))
    plot(rows, models, out / "costmodel_speedup.png")
    for model in models:
        print(f"\n{model} (compute {models[model]} s/step), speedup over flat dense fp32:\n")
        print(markdown(rows, model))
        print(f"\n{model}: seconds per step of every method (PacTrain: best of flat and "
              f"hierarchical; peers flat, codec not modelled):\n")
        print(contenders_markdown(table, model))
    print(f"\nwrote {out / 'costmodel_predictions.json'} and {out / 'costmodel_speedup.png'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
