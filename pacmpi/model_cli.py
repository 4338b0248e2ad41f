"""``pacmpi model calibrate`` and ``pacmpi model predict``: the command lines of the cost model
(:mod:`pacmpi.costmodel`), which fit it to benchmark files and predict a cluster with it."""
import json
import os
import sys

import numpy as np

from .cli_options import add_json_flag, add_peer_options, command_parser
from .costmodel import (
    DEFAULT_FIT,
    FIT_FILE,
    PEER_DEFAULTS,
    TOPOLOGIES,
    calibrate,
    check_int,
    compare,
    latency,
    link_efficiency,
    load_documents,
    predict,
    validate,
)
from .methods import ALLREDUCE_METHODS, METHODS
from .units import parse_rate, parse_size

__all__ = ["calibrate_main", "predict_main"]


def format_points(points):
    """One line per point: the measured time the prediction was compared with (a peer's step
    less its codec, marked "network")."""
    lines = [f"{'source':<34} {'method':>17} {'dens':>5} {'measured(s)':>11} "
             f"{'predicted(s)':>12} {'error':>7}"]
    for p in points:
        lines.append(f"{p['source']:<34} {p['method']:>17} {p['density']:>5.2f} "
                     f"{p.get('compared_s', p['measured_s']):>11.3f} "
                     f"{p['predicted_s']:>12.3f} {p['error']:>+7.1%}"
                     + ("  (network)" if p.get("compared") == "network" else ""))
    return "\n".join(lines)


def build_calibrate_parser():
    parser = command_parser("pacmpi model calibrate", calibrate_main.__doc__)
    parser.add_argument("--json", nargs="+", required=True, metavar="FILE",
                        help="`pacmpi bench allreduce --model NAME (or --sizes) --link RATE "
                             "--json` files to fit (TopK's rows are predicted, not fitted); "
                             "required")
    parser.add_argument("--validate", nargs="*", default=[], metavar="FILE",
                        help="held-out benchmark files: predicted vs measured, not fitted "
                             "(default: none)")
    parser.add_argument("--host-cores", type=int, default=os.cpu_count(), metavar="N",
                        help="cores the benchmark's ranks shared (default: this host's, "
                             "%(default)s)")
    parser.add_argument("--intra-rate", default="160gbit", metavar="RATE",
                        help="a node's internal all-reduce rate for hierarchical predictions, "
                             "tc units (not fitted; default %(default)s, PCIe 4.0 x16)")
    parser.add_argument("--out", default=FIT_FILE, metavar="FILE",
                        help="where to write the fitted model, JSON (default %(default)s)")
    return parser


def calibrate_main(argv=None):
    """``pacmpi model calibrate``: fit the cost model (latency, link efficiency, codec rates) to
    ``pacmpi bench allreduce --link`` JSON files; prints the fit with its error on every point
    and held-out run, and writes it to ``--out`` (what ``pacmpi model predict`` reads)."""
    args = build_calibrate_parser().parse_args(argv)
    check_int("--host-cores", args.host_cores)
    fit = calibrate(load_documents(args.json), host_cores=args.host_cores,
                    intra_Bps=parse_rate(args.intra_rate) / 8)
    fit["fit_files"] = [os.path.basename(p) for p in args.json]
    fit["validation"] = validate(fit, load_documents(args.validate)) if args.validate else []
    with open(args.out, "w") as fh:
        json.dump(fit, fh, indent=2)
    for t in fit["link_efficiency"]:
        print(f"{t}: a = {latency(fit, t) * 1e6:.1f} us per ring step, link efficiency "
              f"{link_efficiency(fit, t):.3f}")
    print("codec s/byte (all values, kept values), verify s/byte:")
    for method in ALLREDUCE_METHODS:
        u, v = fit["codec_s_per_byte"][method]
        print(f"  {method:>17}: {u:.3e}, {v:.3e}; {fit['verify_s_per_byte'][method]:.3e}")
    print("\nfitted points:\n" + format_points(fit["points"]))
    if fit["validation"]:
        errors = np.abs([p["error"] for p in fit["validation"]])
        print("\nheld-out points:\n" + format_points(fit["validation"]))
        print(f"held-out |error|: mean {errors.mean():.1%}, max {errors.max():.1%}, "
              f"{int(np.sum(errors <= 0.15))}/{errors.size} within 15%")
    print(f"wrote {args.out}")
    return 0


def describe_fit(fit, source):
    """One line on which calibration a prediction uses and how far it is trusted: the runs it
    was fitted on and its held-out points within 15% (per topology)."""
    if source is None:
        return ("calibration: none (the uncalibrated model: nominal link rates, no latency, "
                "free codec; a lower bound)")
    text = f"calibration: {source}"
    if fit.get("fit_files"):
        text += f", fitted on {len(fit['fit_files'])} runs ({', '.join(fit['fit_files'])})"
    held_out = fit.get("validation") or []
    if not held_out:
        return text + "; no held-out runs checked it"
    parts = []
    for peers in (False, True):  # a peer's network part only: its codec is not modelled
        for topology in TOPOLOGIES:
            errors = [abs(p["error"]) for p in held_out if p.get("topology", "shared") == topology
                      and (p.get("compared") == "network") == peers]
            if errors:
                parts.append(f"{topology}{' peers (network)' if peers else ''} "
                             f"{sum(e <= 0.15 for e in errors)}/{len(errors)} "
                             f"(max {max(errors):.0%})")
    return text + f"; held-out points within 15%: {', '.join(parts)}"


def format_comparison(rows):
    """:func:`compare`'s rows as a table, fastest first, and the winner named."""
    lines = [f"{'method':<24} {'setting':<12} {'collective':>10} {'s/step':>9} {'network':>9} "
             f"{'latency':>9} {'codec':>9} {'wire B/rank':>13} {'x dense':>8}"]
    for row in rows:
        name = row["method"] + (" (hier.)" if row["hierarchical"] else "")
        codec = ("n/a" if row["codec_s"] is None else
                 f"{row['codec_s'] + row['verify_s'] + row['intra_s']:.4f}")
        lines.append(f"{name:<24} {row['setting']:<12} {row['collective']:>10} "
                     f"{row['seconds']:>9.4f} {row['network_s']:>9.4f} {row['latency_s']:>9.4f} "
                     f"{codec:>9} {row['wire_bytes']:>13,} {row['speedup_vs_dense']:>8.2f}")
    best = rows[0]
    lines.append(f"fastest: {best['method']} {best['setting']}".rstrip() +
                 f", {best['seconds']:.4f} s per step, "
                 f"x{best['speedup_vs_dense']:.2f} vs dense (time only: the methods differ in "
                 f"what they send, and in accuracy; peers' codec n/a = not modelled)")
    return "\n".join(lines)


def build_predict_parser():
    from .bench.models import MODELS

    parser = command_parser("pacmpi model predict", predict_main.__doc__)
    parser.add_argument("--ranks", type=int, required=True, metavar="N",
                        help="ranks of the predicted job; required")
    parser.add_argument("--nodes", type=int, default=None, metavar="K",
                        help="nodes the ranks fill evenly (default: one rank per node)")
    parser.add_argument("--link", required=True, metavar="RATE",
                        help="per-node (star) or shared link rate, tc units (100mbit, 1gbit, "
                             "...); required")
    parser.add_argument("--topology", choices=TOPOLOGIES, default="star",
                        help="star: every node has its own link to a switch; shared: all "
                             "traffic crosses one link")
    size = parser.add_mutually_exclusive_group(required=True)
    size.add_argument("--model", choices=MODELS,
                      help="the gradient of this architecture, in 25 MiB fusion buckets (this "
                           "or --bytes is required)")
    size.add_argument("--bytes", dest="nbytes", metavar="SIZE",
                      help="float32 gradient bytes, K/M/G binary (e.g. 100M), one bucket")
    parser.add_argument("--density", type=float, default=1.0,
                        help="PacTrain's mask density: the fraction of the gradient kept")
    parser.add_argument("--method", default="pactrain",
                        help=f"one of {', '.join(METHODS)}")
    parser.add_argument("--compare", action="store_true",
                        help="every method, fastest first, the winner named")
    add_peer_options(parser)
    parser.add_argument("--compute-s", type=float, default=0.0, metavar="SECONDS",
                        help="compute seconds per step, not overlapped with communication")
    parser.add_argument("--hierarchical", action="store_true",
                        help="reduce in two levels: within each node at the fit's intra-node "
                             "rate, then across one leader per node")
    parser.add_argument("--host-cores", type=int, default=None, metavar="N",
                        help="all ranks share one host of this many cores, which slows their "
                             "codec (the test bed; default: a host per node, cores enough)")
    parser.add_argument("--no-codec", action="store_true",
                        help="free codec and verification (a GPU's kernels, a lower bound)")
    parser.add_argument("--fit", default=None, metavar="FILE",
                        help=f"fitted model from `pacmpi model calibrate` (default {FIT_FILE} "
                             f"when it exists here, else uncalibrated; 'none': uncalibrated)")
    add_json_flag(parser)
    return parser


def predict_main(argv=None):
    """``pacmpi model predict``: predict the seconds per step of a model's gradient all-reduce
    on a cluster you describe (ranks, nodes, link) from the calibrated cost model; prints the
    step time and the speedup over dense fp32 and fp16, or every method, fastest first
    (``--compare``), or JSON."""
    parser = build_predict_parser()
    args = parser.parse_args(argv)
    if args.fit is None and not os.path.exists(FIT_FILE):
        # Outside the repository (an installed wheel, another directory) there is no fit; say
        # so rather than fail, since the uncalibrated model is still the formula.
        print(f"pacmpi model predict: no {FIT_FILE} here, using the uncalibrated model "
              f"(--fit FILE to choose one)", file=sys.stderr)
        args.fit = "none"
    source = None if args.fit == "none" else args.fit or FIT_FILE
    if source is None:
        fit = DEFAULT_FIT
    else:
        try:
            with open(source) as fh:
                fit = json.load(fh)
        except (OSError, ValueError) as exc:
            parser.error(f"cannot read --fit {source!r}: {exc}")
    options = dict(ranks=args.ranks, link=args.link, density=args.density, model=args.model,
                   nodes=args.nodes, topology=args.topology, hierarchical=args.hierarchical,
                   compute_s=args.compute_s, host_cores=args.host_cores, codec=not args.no_codec,
                   **{name: getattr(args, name) for name in PEER_DEFAULTS})
    try:
        options["nbytes"] = None if args.nbytes is None else parse_size(args.nbytes)
        result = (compare(fit, **options) if args.compare else
                  predict(fit, method=args.method, **options))
    except ValueError as exc:
        parser.error(str(exc))
    calibration = describe_fit(fit, source)
    if args.json:
        print(json.dumps({"calibration": calibration, "rows": result} if args.compare else
                         dict(result, calibration=calibration), indent=2))
        return 0
    print(calibration)
    if args.compare:
        print(format_comparison(result))
        return 0
    codec = ("n/a" if result["codec_s"] is None else
             f"{result['codec_s'] + result['verify_s']:.4f}")
    print(f"{result['method']}{' (hierarchical)' if args.hierarchical else ''}: "
          f"{result['seconds']:.4f} s per step (network {result['network_s']:.4f}, codec "
          f"{codec}, compute {result['compute_s']:.4f}); "
          f"x{result['speedup_vs_dense']:.2f} vs dense, "
          f"x{result['speedup_vs_fp16']:.2f} vs fp16")
    return 0


if __name__ == "__main__":
    sys.exit(predict_main())
