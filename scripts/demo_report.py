"""The table `make demo` ends with, from ``demo_train.py``'s JSON: per method the time per step,
the time to the target accuracy and its speedup over dense, the bytes each rank sends per step
and the final accuracy, under one line naming the link and the ranks. Time to target and
speedups are ``pacmpi bench train``'s (computed by ``demo_train.py`` through its ``derive``)."""
import json
import sys

from pacmpi.bench.harness import format_table, format_value
from pacmpi.units import format_rate, parse_rate

NAMES = {"dense": "dense fp32 all-reduce", "pactrain": "PacTrain",
         "pactrain-ternary": "PacTrain+ternary"}
COLUMNS = [
    ("method", lambda run: (NAMES.get(run["method"], run["label"]) if run["ratio"] == 0 else
                            f"{NAMES.get(run['method'], run['label'])}, {run['ratio']:.0%} pruned"),
     "<29"),
    ("ms/step", lambda run: run["step_seconds"]["seconds"] * 1e3, ">7.0f"),
    ("to target (s)", "tta_seconds", ">13.1f", "never"),
    ("x dense", "speedup_vs_dense", ">7.2f", "-"),
    ("bytes/step", "bytes_per_step", ">10,.0f"),
    ("accuracy", "final_accuracy", ">8.4f"),
]


def format_report(report):
    """The demo's table as text (one link: the JSON's only rate)."""
    (rate, block), = report["rates"].items()
    cfg, runs = report["config"], list(block["runs"].values())
    link = ("unshaped (the host's own transport)" if rate == "none" else
            f"{format_rate(parse_rate(rate))}, one shared link shaped by pacmpi-run --link")
    dense = block["runs"][block["reference"]]
    step = dense["step_seconds"]
    busy = step["compute"] + step.get("optimizer", 0.0)
    return "\n".join([
        f"link: {link}; {cfg['ranks']} ranks; digits CNN ({dense['parameters']:,} parameters), "
        f"{cfg['epochs']} epochs",
        format_table(runs, COLUMNS, sep="  "),
        f"target: test accuracy {format_value(block['target_accuracy'], '.4f')} = "
        f"{cfg['target_fraction']:.0%} of dense's final (pretrained model: "
        f"{dense['pretrained_accuracy']:.4f}),",
        f"  checked after every epoch; never = not within {cfg['epochs']} epochs; "
        "x dense = dense's time to target / the method's",
        f"dense's step: {step['seconds'] * 1e3:.0f} ms, of which {busy * 1e3:.0f} ms compute: "
        f"{1 - busy / step['seconds']:.0%} is communication (and waiting for other ranks)",
    ])


def main(argv):
    with open(argv[0]) as f:
        print(format_report(json.load(f)))


if __name__ == "__main__":
    main(sys.argv[1:])
