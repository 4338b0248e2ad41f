"""Benchmark: the test bed's run-to-run spread, the same configuration run R times.

Usage (root; on a quiet machine, alone, e.g. under ``flock``)::

    python -m pacmpi.launch.bench_spread --nodes 2,3,4 --rates 100mbit,1gbit \\
        --topologies star,shared --runs 5 --json spread.json

Each run is what a user runs: ``pacmpi-run -n K --nodes K --link RATE --topology T`` (one rank
per node, calibrated first, the ring all-reduce pinned by ``pacmpi-run``) around a dense
float32 all-reduce job (:mod:`._allreduce_timer`: ``--iters`` calls after a warm-up, the
slowest rank's time, the median kept; #wrong counted; the algorithm read back from the
library must be the ring). S is chosen so that one call takes ``--seconds`` by the model:
``2(K-1)/K * S / B`` on the star, ``2(K-1) * S / B`` through the shared queue. Per
configuration: every run's time and its ratio to the model, the median, min and max of the
R runs, the spread ``(max - min) / median`` and the range of the runs' calibration ratios.
A spread above 10% means a single run cannot check a prediction to within 15%.
"""
import argparse
import sys

from pacmpi.bench.harness import spread, write_report
from pacmpi.costmodel import ring_seconds
from pacmpi.units import parse_rate

from ._allreduce_timer import command, report
from ._sweep import sweep
from .runner import run_command
from .testbed import format_rate

__all__ = ["measure", "summarize", "format_table", "main"]


def model_seconds(nodes, topology, nbytes, rate_bps):
    """Seconds of one ring all-reduce of ``nbytes`` over ``nodes`` nodes' links at nominal
    rate (bits per second): :func:`pacmpi.costmodel.ring_seconds`."""
    return ring_seconds(nbytes, nodes, rate_bps / 8, topology)


def summarize(times, model_s, calibration_ratios=()):
    """One configuration's runs: the :func:`~pacmpi.bench.harness.spread` of the times and of
    their ratios to ``model_s``, and ``spread`` = (max - min) / median of the times."""
    stat = spread(list(times))
    ratios = spread([model_s / t for t in times])
    return {"times_s": stat, "of_model": ratios, "model_s": model_s,
            "spread": (stat["max"] - stat["min"]) / stat["median"],
            "calibration": spread(list(calibration_ratios))}


def measure(nodes, rates, topologies, *, runs=5, seconds=1.0, iters=3, calibrate=True,
            mpirun=None, timeout=600):
    """Run every (topology, rate, node count) ``runs`` times; return the summary dicts."""
    def point(count, rate, topology):
        rate_bps = parse_rate(rate)
        nbytes = int(seconds / model_seconds(count, topology, 1, rate_bps)) // 4 * 4
        times, calibrations = [], []
        for _ in range(runs):
            times.append(_run(count, rate, topology, nbytes, iters, calibrate, mpirun, timeout,
                              calibrations))
        return dict(summarize(times, model_seconds(count, topology, nbytes, rate_bps),
                              calibrations),
                    topology=topology, rate=rate, nominal_bps=rate_bps, nodes=count,
                    nbytes=nbytes, runs=runs, iters=iters)

    return sweep(nodes, rates, topologies, point, format_table)


def _run(count, rate, topology, nbytes, iters, calibrate, mpirun, timeout, calibrations):
    """One run's median seconds per call; its calibration ratio appended to ``calibrations``."""
    result = run_command(command([nbytes], iters, 1), count, nodes=count, link=rate,
                         topology=topology, calibrate=calibrate, capture=True, echo=False,
                         tag_output=False, mpirun=mpirun, timeout=timeout)
    measured = report(result.stdout)
    if result.returncode != 0 or measured is None:
        raise RuntimeError(f"{count} nodes, {rate}, {topology}: the job failed (exit status "
                           f"{result.returncode}): {result.stderr.strip()[-1500:]}")
    row = measured["rows"][0]
    if measured["ran"] != "ring" or row["wrong"]:
        raise RuntimeError(f"{count} nodes, {rate}, {topology}: ran {measured['ran']!r} with "
                           f"{row['wrong']} wrong elements; the model is the ring's")
    if result.calibration:
        calibrations.append(result.calibration["ratio"])
    return row["median_s"]


def format_table(points, header=True):
    """Rows: configuration, S, model time, runs' median [min, max], of model, spread."""
    lines = []
    if header:
        lines += ["| topology | rate | nodes | S (bytes) | model | time/call median [min, max] "
                  "| of model median [min, max] | spread | calibration [min, max] |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        t, r, c = p["times_s"], p["of_model"], p["calibration"]
        cal = f"{c['min']:.1%}, {c['max']:.1%}" if c["n"] else "-"
        lines.append(f"| {p['topology']} | {format_rate(p['nominal_bps'])} | {p['nodes']} | "
                     f"{p['nbytes']} | {p['model_s']:.3f} s | {t['median']:.3f} "
                     f"[{t['min']:.3f}, {t['max']:.3f}] s | {r['median']:.1%} "
                     f"[{r['min']:.1%}, {r['max']:.1%}] | {p['spread']:.1%} | {cal} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pacmpi.launch.bench_spread",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="2,3,4", help="node counts, comma-separated")
    parser.add_argument("--rates", default="100mbit,1gbit", help="link rates, comma-separated")
    parser.add_argument("--topologies", default="star,shared", help="star and/or shared")
    parser.add_argument("--runs", type=int, default=5, help="runs per configuration")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="model seconds per all-reduce call (sets S; default 1)")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per run")
    parser.add_argument("--no-calibrate", action="store_true")
    parser.add_argument("--mpirun", help="MPI launcher (default: as pacmpi-run finds it)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.runs < 2:
        parser.error(f"--runs must be at least 2 for a spread, got {args.runs}")
    points = measure([int(k) for k in args.nodes.split(",")], args.rates.split(","),
                     args.topologies.split(","), runs=args.runs, seconds=args.seconds,
                     iters=args.iters, calibrate=not args.no_calibrate, mpirun=args.mpirun)
    if args.json:
        write_report(args.json, {"points": points}, parser.prog)
    return 0


if __name__ == "__main__":
    sys.exit(main())
