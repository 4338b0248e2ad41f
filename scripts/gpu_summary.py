"""One table from scripts/gpu_check.sh's OUT_DIR: every step's outcome, and the codec kernels'
share of the device's memory bandwidth against the goals (pack/unpack >= 80%, ternary
encode+decode >= 60% of copyto's measured bandwidth)."""
import json
import sys
from pathlib import Path

GOALS = {"pack (gather)": (("gather",), 0.8), "unpack (scatter)": (("scatter",), 0.8),
         "ternary encode+decode": (("ternary_encode", "ternary_decode"), 0.6)}


def bandwidth_rows(report):
    """``(what, density, share, goal)``: each goal's ops together (bytes over seconds) as a
    share of copyto's bandwidth at the same density."""
    rows = []
    for density in report["config"]["densities"]:
        at = {r["op"]: r for r in report["rows"] if r["density"] == density}
        for what, (ops, goal) in GOALS.items():
            if all(op in at for op in ops):
                moved = sum(at[op]["moved_GBps"] * at[op]["best_s"] for op in ops)
                rate = moved / sum(at[op]["best_s"] for op in ops)
                rows.append((what, density, rate / at["copyto"]["moved_GBps"], goal))
    return rows


def main(out):
    out = Path(out)
    print(f"{'step':<28}{'outcome':<14}{'seconds':>8}")
    for line in (out / "steps.tsv").read_text().splitlines():
        name, outcome, seconds = line.split("\t")
        print(f"{name:<28}{outcome:<14}{seconds:>8}")
    for path in sorted(out.glob("codec_*.json")):
        report = json.loads(path.read_text())
        config = report["config"]
        copy = max(r["moved_GBps"] for r in report["rows"] if r["op"] == "copyto")
        nominal = config.get("nominal_GBps")
        print(f"\n{config['dtype']} kernels on {config.get('gpu', '?')}: copyto {copy:.0f} GB/s"
              + (f" ({copy / nominal:.0%} of the nominal {nominal:.0f} GB/s)" if nominal else ""))
        for what, density, share, goal in bandwidth_rows(report):
            verdict = "met" if share >= goal else "MISSED"
            print(f"  {what:<24} density {density:<4} {share:>5.0%} of copyto "
                  f"(goal {goal:.0%}: {verdict})")
    hook = out / "hook_cuda.json"
    if hook.exists():
        hook_tables(json.loads(hook.read_text()))
    return 0


def hook_tables(report):
    """``pacmpi bench hook --device cuda``: memory above plain DDP and the step time at 40 and
    400 tensors, with issue 23's targets (pacmpi's own time at 400 tensors <= 1.2x at 40; the
    hook's step <= 1.25x plain DDP's at 400)."""
    from pacmpi.bench.memory import format_table
    from pacmpi.experiments.bench_hook import format_time_table

    if report.get("memory"):
        print(f"\nDDP hook on CUDA, {report['ranks']} rank(s): pacmpi's memory as a ratio of the "
              f"gradient bytes (peak: device memory above plain DDP's)")
        print(format_table(report["memory"]))
    rows = report.get("time") or []
    if rows:
        print("\nDDP step time on CUDA")
        print(format_time_table(rows))
        at = {(r["tensors"], r["mode"]): r for r in rows}
        few, many = min(r["tensors"] for r in rows), max(r["tensors"] for r in rows)
        for mode in ("lossless", "ternary"):
            if (few, mode) in at and (many, mode) in at and (many, "plain") in at:
                own = at[many, mode]["pacmpi_ms"] / at[few, mode]["pacmpi_ms"]
                step = at[many, mode]["step_ms"] / at[many, "plain"]["step_ms"]
                print(f"  {mode:<9} own time {many}/{few} tensors {own:.2f}x (goal <= 1.2), "
                      f"step at {many} tensors {step:.2f}x plain DDP (goal <= 1.25)")


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:]))
