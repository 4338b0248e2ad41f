"""``pacmpi tune``: time the MPI library's all-reduce algorithms on your payload sizes, one job per
algorithm; prints the fastest settings to export (an Open MPI rules file when the winner changes
with the size), and ``--json`` writes every measurement.

In the spirit of osu_allreduce and nccl-tests' all_reduce_perf, once per algorithm: Open MPI
reads ``coll_tuned_allreduce_algorithm`` when MPI starts, so every algorithm runs as a job of
its own (``pacmpi-run``'s launch, optionally on the test bed: ``--link``/``--nodes``), timing
float32 all-reduces of each size and counting wrong elements. The sizes are ``--sizes`` or the
fusion buckets of ``--model NAME`` (what a training step all-reduces). The algorithms are the
library's own list: Open MPI's ``coll_tuned_allreduce_algorithm`` values as ``ompi_info``
lists them, MPICH's ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM`` values as ``mpivars`` describes
them, plus the default choice. ``--nonblocking`` tunes ``MPI_Iallreduce`` instead, called in
place as ``PacTrainReducer`` calls it: the libraries choose it apart (Open MPI's
``coll_libnbc_iallreduce_algorithm``, whose own choice for an in-place buffer is a binomial
tree; MPICH's ``MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM``). One winner for every size: its
environment variables. Winners that change with the size (Open MPI's blocking all-reduce): a
rules file (``coll_tuned_dynamic_rules_filename``, one rule per size range, for the tuned rank
count) and the variables that load it; elsewhere the library takes one value, the fastest in
total. A last job started with exactly the printed lines reads back from the library what it
was told to run. Why a command of its own and not ``pacmpi doctor``: the doctor answers in
seconds what is set; this starts one job per algorithm and measures.
"""
import math
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pacmpi.bench import harness
from pacmpi.bench.models import MODELS
from pacmpi.buckets import BucketLayout
from pacmpi.cli_options import (
    add_hostfile,
    add_iters,
    add_json_file,
    add_link,
    add_mpirun,
    add_nodes,
    add_oversubscribe,
    add_timeout,
    add_warmup,
    command_parser,
)
from pacmpi.costmodel import tensors
from pacmpi.units import parse_size

from ._allreduce_timer import command, report
from .mpi import MPICH, OPENMPI, detect_mpi
from .runner import run_command
from .testbed import CalibrationError, TestbedError

__all__ = ["main", "Candidate", "candidates", "rules_file"]

_ALLREDUCE_ID = 2  # ALLREDUCE in Open MPI's COLLTYPE enumeration (coll_base_functions.h)
_DYNAMIC = "OMPI_MCA_coll_tuned_use_dynamic_rules"
_FORCED = "OMPI_MCA_coll_tuned_allreduce_algorithm"
_RULES = "OMPI_MCA_coll_tuned_dynamic_rules_filename"
_NBC = "OMPI_MCA_coll_libnbc_iallreduce_algorithm"


@dataclass(frozen=True)
class Candidate:
    """One algorithm to time: its ``name`` (what the library reads back), its ``number`` (Open
    MPI's id; None otherwise) and the ``env`` entries (``NAME=VALUE``) that select it."""

    name: str
    number: object
    env: tuple


def openmpi_algorithms(flavor, nonblocking=False):
    """``{number: name}`` of Open MPI's all-reduce algorithms (coll/tuned's, or with
    ``nonblocking`` coll/libnbc's non-blocking ones), from the ``ompi_info`` beside ``mpirun``
    (0, "ignore", is the default choice, not an algorithm)."""
    ompi_info = Path(flavor.mpirun).with_name("ompi_info")
    component = "libnbc" if nonblocking else "tuned"
    done = subprocess.run([str(ompi_info), "--parsable", "--param", "coll", component,
                           "--level", "9"], capture_output=True, text=True, timeout=60)
    param = (_NBC if nonblocking else _FORCED).removeprefix("OMPI_MCA_")
    prefix = f"mca:coll:{component}:param:{param}:enumerator:value:"
    found = {}
    for line in done.stdout.splitlines():
        if line.startswith(prefix):
            number, _, name = line[len(prefix):].partition(":")
            if int(number):
                found[int(number)] = name
    if not found:
        raise ValueError(f"{ompi_info} lists no {param} values (exit status "
                         f"{done.returncode}): is coll/{component} built?")
    return found


def mpich_algorithms(flavor, nonblocking=False):
    """``{number: name}`` of MPICH's (blocking or non-blocking) all-reduce algorithms, as the
    ``mpivars`` beside ``mpiexec`` describes ``MPIR_CVAR_[I]ALLREDUCE_INTRA_ALGORITHM``: one
    ``name - what it does`` line per value, in order (0, "auto", is the default choice)."""
    mpivars = Path(flavor.mpirun).with_name("mpivars")
    done = subprocess.run([str(mpivars)], capture_output=True, text=True, timeout=60)
    variable = _mpich_variable(nonblocking)
    lines = done.stdout.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"\t{variable}=")),
                 None)
    if start is None:
        raise ValueError(f"{mpivars} does not describe {variable} (exit status "
                         f"{done.returncode})")
    found = {}
    for line in lines[start + 1:]:
        if line.startswith("\t") or " - " not in line:
            break
        found[len(found)] = line.partition(" - ")[0].strip()
    found.pop(0, None)
    if not found:
        raise ValueError(f"{mpivars} lists no values of {variable}")
    return found


def _mpich_variable(nonblocking):
    return f"MPIR_CVAR_{'IALLREDUCE' if nonblocking else 'ALLREDUCE'}_INTRA_ALGORITHM"


def candidates(flavor, chosen=None, nonblocking=False):
    """The :class:`Candidate` list for ``flavor``'s blocking (or ``nonblocking``) all-reduce:
    every algorithm and the default choice, or the ``chosen`` ones (numbers or names;
    ``"default"``). A value the library does not have is a ValueError naming it and listing
    the valid ones."""
    # Per library: its algorithms, the settings of its default choice and of algorithm k.
    if flavor.kind == OPENMPI and nonblocking:
        known = openmpi_algorithms(flavor, nonblocking)
        default, setting = (f"{_NBC}=0",), lambda k, name: (f"{_NBC}={k}",)
    elif flavor.kind == OPENMPI:
        known = openmpi_algorithms(flavor, nonblocking)
        default, setting = (f"{_DYNAMIC}=0",), lambda k, name: (f"{_DYNAMIC}=1",
                                                                f"{_FORCED}={k}")
    elif flavor.kind == MPICH:
        known, variable = mpich_algorithms(flavor, nonblocking), _mpich_variable(nonblocking)
        default, setting = (f"{variable}=auto",), lambda k, name: (f"{variable}={name}",)
    else:
        raise ValueError(f"pacmpi tune knows Open MPI and MPICH, not {flavor.describe()}")
    everything = [Candidate("default", None, default)] + [
        Candidate(name, k, setting(k, name)) for k, name in sorted(known.items())]
    if not chosen:
        return everything
    listing = ", ".join(f"{number} {name}" for number, name in sorted(known.items()))
    picked = []
    for value in chosen:
        match = [c for c in everything if value in (c.name, str(c.number))]
        if not match:
            raise ValueError(f"{'non-blocking ' if nonblocking else ''}all-reduce algorithm "
                             f"{value!r} is not one of {flavor.name}'s: default, {listing}")
        picked += [c for c in match if c not in picked]
    return picked


def bucket_sizes(model):
    """The distinct byte sizes of ``model``'s 25 MiB fusion buckets (float32), ascending."""
    shapes = tensors(model=model)[0]
    layout = BucketLayout(shapes, [np.float32] * len(shapes))
    return sorted({bucket.nbytes for bucket in layout.buckets})


def rules_file(winners, ranks):
    """Open MPI's dynamic rules file (the classic format: collectives, collective id, comm
    sizes, comm size, rules of ``message-bytes algorithm fan-in/out segment-size``) choosing
    for ``ranks`` ranks, per size range, the winner measured in it. ``winners``: ``[(bytes,
    Candidate)]`` ascending; a range starts halfway (geometrically) between two measured
    sizes. Open MPI takes the rule with the largest message size not above the call's bytes,
    for the largest comm size not above the communicator's (smaller ones: its fixed rules)."""
    rules, previous = [], None
    for i, (nbytes, candidate) in enumerate(winners):
        if candidate is previous:
            continue
        start = 0 if i == 0 else math.isqrt(winners[i - 1][0] * nbytes)
        rules.append(f"{start} {candidate.number or 0} 0 0")  # 0: Open MPI's fixed choice
        previous = candidate
    return "\n".join(["1", str(_ALLREDUCE_ID), "1", str(ranks), str(len(rules)), *rules]) + "\n"


def _job(sizes, iters, warmup, n, env, args):
    """Time ``sizes`` on ``n`` ranks as ``pacmpi-run`` would start them, with ``env``; the
    worker's report."""
    result = run_command(command(sizes, iters, warmup, args.nonblocking), n, link=args.link,
                         nodes=args.nodes,
                         env=list(env), calibrate=False, capture=True, echo=False,
                         timeout=args.timeout, mpirun=args.mpirun, tag_output=False,
                         allreduce="default", oversubscribe=args.oversubscribe,
                         hostfile=args.hostfile)
    measured = report(result.stdout)
    if result.returncode != 0 or measured is None:
        tail = (result.stderr or result.stdout).strip().splitlines()
        raise JobFailed(f"{' '.join(env)}: the job failed (exit status {result.returncode}): "
                        + (tail[-1] if tail else "no output"))
    return measured


class JobFailed(RuntimeError):
    """A timing job that did not report: the library crashed or refused the setting."""


def _size(nbytes):
    return next(f"{nbytes / 2**s:g} {u}" for s, u in ((30, "GiB"), (20, "MiB"), (10, "KiB"),
                                                       (0, "B")) if nbytes >= 2**s or not s)


def build_parser():
    parser = command_parser("pacmpi tune", __doc__)
    parser.add_argument("-n", "--np", type=int, default=2, metavar="N",
                        help="ranks to tune for (default %(default)s; rules apply from N up)")
    what = parser.add_mutually_exclusive_group()
    what.add_argument("--sizes", default="4K,64K,1M,16M", metavar="SIZE,SIZE",
                      help="payload bytes per all-reduce, comma-separated, K/M/G binary "
                           "(default %(default)s)")
    what.add_argument("--model", metavar="NAME",
                      help="time the fusion buckets of this model instead of --sizes: one of "
                           + ", ".join(MODELS))
    parser.add_argument("--nonblocking", action="store_true",
                        help="tune the non-blocking all-reduce (MPI_Iallreduce, in place), "
                             "which PacTrainReducer runs, instead of MPI_Allreduce (Horovod's)")
    parser.add_argument("--algorithms", default=None,
                        metavar="A,A",
                        help="comma-separated numbers or names to time (default: all, and "
                             "the library's default choice)")
    add_iters(parser, 5, "timed all-reduces per size and algorithm")
    add_warmup(parser, 1, "untimed all-reduces before them")
    add_link(parser)
    add_nodes(parser)
    add_oversubscribe(parser)
    add_hostfile(parser)
    add_mpirun(parser)
    add_timeout(parser, 600, "seconds per job (one per algorithm)")
    parser.add_argument("--rules", default="pacmpi-allreduce-rules.conf", metavar="FILE",
                        help="where to write an Open MPI rules file when the winner changes "
                             "with the size (default %(default)s)")
    add_json_file(parser, "every measurement")
    return parser


def main(argv=None):
    """Console entry point; exit status 0, or 2 with an error naming the bad value."""
    args = build_parser().parse_args(argv)
    try:
        return _tune(args)
    except (ValueError, RuntimeError, TestbedError, CalibrationError, OSError) as exc:
        print(f"pacmpi tune: error: {exc}", file=sys.stderr)
        return 2


def _tune(args):
    if args.model is not None and args.model not in MODELS:
        raise ValueError(f"unknown model {args.model!r}; choose from {', '.join(MODELS)}")
    sizes = sorted(bucket_sizes(args.model) if args.model else
                   {parse_size(s) for s in args.sizes.split(",")})
    flavor = detect_mpi(args.mpirun)
    chosen = args.algorithms.split(",") if args.algorithms else None
    runs, failed = [], []
    for candidate in candidates(flavor, chosen, args.nonblocking):
        try:
            measured = _job(sizes, args.iters, args.warmup, args.np, candidate.env, args)
        except JobFailed as exc:  # one algorithm the library cannot run is a result, not an end
            failed.append(str(exc))
            continue
        if measured["ran"] != candidate.name:
            raise RuntimeError(f"told {' '.join(candidate.env)}, the library ran "
                               f"{measured['ran']!r}")
        runs.append((candidate, measured))
    if not runs:
        raise RuntimeError("every algorithm's job failed: " + "; ".join(failed))
    print(f"pacmpi tune: {flavor.describe()}, "
          f"{'non-blocking (Iallreduce, in place)' if args.nonblocking else 'MPI_Allreduce'}, "
          f"{args.np} ranks"
          f"{f', link {args.link}' if args.link else ''}; median time per all-reduce (us), "
          f"slowest rank, {args.iters} calls after {args.warmup} warm-up")
    winners = []
    for i, nbytes in enumerate(sizes):
        valid = [(c, m["rows"][i]) for c, m in runs if m["rows"][i]["wrong"] == 0]
        if not valid:
            raise RuntimeError(f"every algorithm summed {_size(nbytes)} wrongly")
        winners.append((nbytes, min(valid, key=lambda cr: cr[1]["median_s"])[0]))
    columns = [harness.Column("size", lambda i: _size(sizes[i]), ">9")] + [
        harness.Column(c.name, lambda i, m=m: m["rows"][i]["median_s"] * 1e6, ">9.1f")
        for c, m in runs] + [harness.Column("fastest", lambda i: winners[i][1].name, "<")]
    print(harness.format_table(range(len(sizes)), columns))
    wrong = {c.name: sum(row["wrong"] for row in m["rows"]) for c, m in runs}
    print("#wrong: " + (", ".join(f"{k} {v}" for k, v in wrong.items() if v) or "0 everywhere"))
    for why in failed:
        print(f"#failed, left out: {why}")
    env = _recommend(winners, runs, args, flavor)
    # The printed lines, exactly, in a fresh job: what does the library say it runs?
    check = _job(sizes, 1, 0, args.np, env, args)
    if sum(row["wrong"] for row in check["rows"]):
        raise RuntimeError(f"with {' '.join(env)} the sums came out wrong")
    print(f"checked: a fresh {args.np}-rank job with these lines ran "
          f"{check['ran'] or 'what the library does not report'}, every sum exact")
    if args.json:
        harness.write_report(args.json, {
            "mpi": flavor.describe(), "nonblocking": args.nonblocking, "ranks": args.np,
            "link": args.link, "sizes": sizes,
            "runs": [{"algorithm": c.name, "env": list(c.env), **m} for c, m in runs],
            "fastest": [{"bytes": b, "algorithm": c.name} for b, c in winners],
            "export": env, "checked": check["ran"]}, "pacmpi tune")
    return 0


def _recommend(winners, runs, args, flavor):
    """Print the fastest per size range and the lines to export; return those entries."""
    print("fastest per size range:")
    start = 0
    for i in range(1, len(winners) + 1):
        if i == len(winners) or winners[i][1] is not winners[start][1]:
            span = _size(winners[start][0]) + (f" - {_size(winners[i - 1][0])}"
                                               if i - 1 > start else "")
            print(f"  {span}: {winners[start][1].name}")
            start = i
    distinct = {c for _, c in winners}
    if len(distinct) == 1 or flavor.kind != OPENMPI or args.nonblocking:
        # One setting for all sizes: the winner, or the best in total where the library takes
        # one value (MPICH, Open MPI's libnbc: no rules file).
        best = (next(iter(distinct)) if len(distinct) == 1 else
                min(runs, key=lambda r: sum(row["median_s"] for row in r[1]["rows"]))[0])
        env = list(best.env)
        print(f"export ({best.name} for every size):")
    else:
        path = Path(args.rules).resolve()
        path.write_text(rules_file(winners, args.np))
        env = [f"{_DYNAMIC}=1", f"{_RULES}={path}"]
        print(f"export (a rules file, {path}, since the winner changes with the size):")
    for entry in env:
        name, _, value = entry.partition("=")
        print(f"export {name}={shlex.quote(value)}")
    return env


if __name__ == "__main__":
    sys.exit(main())
