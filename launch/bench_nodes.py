"""Benchmark: calibrate the node test bed over node counts, link rates and topologies.

Usage (root; run it alone on the machine, e.g. under ``flock``)::

    python -m pacmpi.launch.bench_nodes --nodes 2,4,8 --rates 100mbit,1gbit \\
        --topologies star,shared --json nodes.json

Each point builds a :class:`~.nodes.NodeTestbed`, times a ring all-reduce with one rank per
node (:meth:`~.nodes.NodeTestbed.calibrate`, median of 3 calls of ~0.5 s) and records the time
against both models: ``star`` 2(K-1)/K * S / B (each node's private link) and ``shared``
2(K-1) * S / B (one link for all). A star bed that matched the shared model, or ran faster than
its own, would mean traffic is not crossing the links it should: this table is the physical
check. Points more than the tolerance off their own model are kept, marked ``refused``.
The table is printed row by row as points finish; the JSON holds the calibration dicts under
``points``, with the run's environment (:func:`pacmpi.bench.harness.write_report`).
"""
import argparse
import sys

from pacmpi.bench.harness import write_report
from pacmpi.costmodel import ring_seconds

from ._sweep import sweep
from .nodes import NodeTestbed
from .testbed import CalibrationError, format_rate

__all__ = ["measure", "format_table", "main"]


def measure(nodes, rates, topologies, *, tolerance=0.15, mpirun=None):
    """Calibrate every (topology, rate, node count); return the list of result dicts."""
    def point(count, rate, topology):
        with NodeTestbed(count, rate, topology=topology, mpirun=mpirun) as bed:
            try:
                result = dict(bed.calibrate(tolerance=tolerance), refused=False)
            except CalibrationError as exc:
                result = dict(exc.result, refused=True)
        for model in ("star", "shared"):
            result[f"{model}_model_s"] = ring_seconds(result["nbytes"], count,
                                                      result["nominal_bps"] / 8, model)
        return result

    return sweep(nodes, rates, topologies, point, format_table)


def format_table(points, header=True):
    """Rows: topology, rate, nodes, bytes, time, both models, fraction of the star model."""
    lines = []
    if header:
        lines += ["| topology | rate | nodes | S (bytes) | time/call | 2(K-1)/K*S/B | "
                  "2(K-1)*S/B | of own model | refused |",
                  "|---|---|---|---|---|---|---|---|---|"]
    for p in points:
        lines.append(f"| {p['topology']} | {format_rate(p['nominal_bps'])} | {p['n']} | "
                     f"{p['nbytes']} | {p['time_s']:.3f} s | {p['star_model_s']:.3f} s | "
                     f"{p['shared_model_s']:.3f} s | {p['ratio']:.1%} | "
                     f"{'yes' if p['refused'] else 'no'} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pacmpi.launch.bench_nodes",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="2,4,8", help="node counts, comma-separated")
    parser.add_argument("--rates", default="100mbit", help="link rates, comma-separated")
    parser.add_argument("--topologies", default="star", help="star and/or shared")
    parser.add_argument("--tolerance", type=float, default=0.15)
    parser.add_argument("--mpirun", help="MPI launcher (default: as pacmpi-run finds it)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    points = measure([int(k) for k in args.nodes.split(",")], args.rates.split(","),
                     args.topologies.split(","), tolerance=args.tolerance, mpirun=args.mpirun)
    if args.json:
        write_report(args.json, {"points": points}, parser.prog)
    return 1 if any(p["refused"] for p in points) else 0


if __name__ == "__main__":
    sys.exit(main())
