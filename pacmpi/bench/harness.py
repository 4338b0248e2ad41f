"""What every benchmark driver shares: timing, statistics, tables and JSON reports.

A driver (``pacmpi bench allreduce|train|masks|bias``, ``python -m pacmpi.bench.codec``,
``python -m pacmpi.launch.bench_nodes``) decides what to run and which columns it has; how a
call is timed, how repeats are summarized, how a table is laid out and what a report records
about the run are written once, here (as nccl-tests keeps them in its ``common.cu``). NumPy
only, so the core benchmarks, ``launch`` and the experiments can all import it.

Example::

    timing = time_op(lambda: np.copyto(out, flat), iters=5, warmup=1)
    rows = [{"op": "copyto", "best_ms": timing.min * 1e3}]
    print(format_table(rows, [Column("op", "op", ">8"), Column("best(ms)", "best_ms", ">9.2f")]))
    write_report("copy.json", {"rows": rows}, benchmark="my bench")
"""
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Union

import numpy as np

__all__ = ["Timing", "comma_list", "time_op", "spread", "overlap", "format_spread", "format_value",
           "format_table", "environment", "write_report"]


# ---------------------------------------------------------------------------------- timing
@dataclass(frozen=True)
class Timing:
    """The timed calls of :func:`time_op`: ``seconds`` of each (in call order) and what each
    returned (``results``, e.g. the bytes a reduction sent)."""

    seconds: tuple
    results: tuple

    @property
    def mean(self):
        return statistics.fmean(self.seconds)

    @property
    def median(self):
        return statistics.median(self.seconds)

    @property
    def min(self):
        return min(self.seconds)

    @property
    def max(self):
        return max(self.seconds)


def comma_list(kind=str):
    """An argparse ``type=`` for comma-separated values: ``"a, b,"`` -> ``(kind("a"),
    kind("b"))`` (blanks and empty items dropped)."""
    def parse(text):
        return tuple(kind(item.strip()) for item in text.split(",") if item.strip())
    return parse


def time_op(fn, iters, *, warmup=0, setup=None, sync=None, collectives=None):
    """Call ``fn()`` ``warmup + iters`` times and time the last ``iters`` calls.

    ``setup()`` runs before every call, untimed (refill the buffer a reduction works in place
    on). ``sync()`` runs after every call, timed: GPU kernels are asynchronous, so a call ends
    when the device is done. With ``collectives`` (anything with ``allreduce(buf, op)``, the
    same on every rank) the ranks start each call together, after a one-value all-reduce over
    that transport, and each call's time is the slowest rank's: an all-reduce is as slow as its
    last rank. The times are exchanged once, after the loop, so they do not disturb it.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"time_op needs iters >= 1 and warmup >= 0, got iters={iters!r}, "
                         f"warmup={warmup!r}")
    seconds, results = [], []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        if collectives is not None:
            collectives.allreduce(np.zeros(1), "max")  # a barrier over the same transport
        started = time.perf_counter()
        result = fn()
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - started
        if i >= warmup:
            seconds.append(elapsed)
            results.append(result)
    if collectives is not None:
        slowest = np.array(seconds)
        collectives.allreduce(slowest, "max")
        seconds = slowest.tolist()
    return Timing(tuple(seconds), tuple(results))


# ---------------------------------------------------------------------------------- statistics
def spread(values):
    """``{"values", "n", "median", "min", "max"}`` of repeated measurements (seeds, runs).

    A ``None`` (a run that never reached its target, or has no such number) is kept in
    ``values`` and left out of the statistics; ``n`` counts the rest. JSON-able.
    """
    known = sorted(v for v in values if v is not None)
    return {"values": list(values), "n": len(known),
            "median": statistics.median(known) if known else None,
            "min": known[0] if known else None, "max": known[-1] if known else None}


def overlap(a, b):
    """Whether two :func:`spread` ranges ``[min, max]`` overlap (a tie); False when either
    has no value."""
    if a["n"] == 0 or b["n"] == 0:
        return False
    return a["min"] <= b["max"] and b["min"] <= a["max"]


# ---------------------------------------------------------------------------------- text
def format_value(value, spec="", missing="-"):
    """``format(value, spec)``, or ``missing`` for None (a number that does not exist)."""
    return missing if value is None else format(value, spec)


def format_spread(stat, spec, missing="-"):
    """A :func:`spread` as ``"median [min, max]"``, each number formatted with ``spec``;
    ``missing`` when it has no value, and ``" (k <missing>)"`` appended when ``k`` of its
    values are None."""
    if stat["n"] == 0:
        return missing
    text = (f"{format(stat['median'], spec)} [{format(stat['min'], spec)}, "
            f"{format(stat['max'], spec)}]")
    absent = len(stat["values"]) - stat["n"]
    return text + (f" ({absent} {missing})" if absent else "")


class Column(NamedTuple):
    """One column of :func:`format_table`.

    ``value``: the row's key, or a function of the row. ``spec``: ``[<>^][width][rest]``, a
    format spec whose alignment (default right) and width (a minimum: a column grows to fit its
    title and longest cell) lay the column out and whose rest formats the value (``".1f"``).
    ``missing``: the text for a None value.
    """

    title: str
    value: Union[str, Callable[[Any], Any]]
    spec: str = ""
    missing: str = "-"


_SPEC = re.compile(r"([<>^]?)(\d*)(.*)")


def format_table(rows, columns, *, sep=" ", indent=""):
    """Rows (dicts, or whatever the columns' functions take) as fixed-width text: a title line,
    then one line per row; each line starts with ``indent``, columns joined by ``sep``.
    ``columns``: :class:`Column` objects or tuples of their fields."""
    laid_out = []
    for column in (Column(*c) for c in columns):  # a Column, or a tuple of its fields
        align, width, rest = _SPEC.fullmatch(column.spec).groups()
        value = column.value if callable(column.value) else (lambda row, k=column.value: row[k])
        texts = [column.title] + [format_value(value(row), rest, column.missing) for row in rows]
        width = max([int(width or 0)] + [len(text) for text in texts])
        # Formatted to text first, then laid out: format(True, ">5") would print 1.
        laid_out.append([f"{text:{align or '>'}{width}}" for text in texts])
    return "\n".join((indent + sep.join(line)).rstrip() for line in zip(*laid_out))


# ---------------------------------------------------------------------------------- reports
_LIBRARIES = ("pacmpi", "numpy", "mpi4py", "numba", "torch")


def _versions():
    """Installed versions of the libraries a result depends on (read without importing them),
    and of CuPy and the MPI library when this process loaded them."""
    versions = {}
    for name in _LIBRARIES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    if "cupy" in sys.modules:  # its distribution is named after the CUDA version
        versions["cupy"] = sys.modules["cupy"].__version__
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None:  # importing it here would initialize MPI
        versions["mpi"] = mpi.Get_library_version().strip().splitlines()[0]
    return versions


def environment(benchmark):
    """What a report records about the run: ``benchmark`` (its command), ``created`` (UTC),
    ``host`` (``name``, ``platform``, ``cpus``, ``python``), ``versions`` and ``command`` (this
    process's command line)."""
    return {
        "benchmark": benchmark,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": {"name": platform.node(), "platform": platform.platform(),
                 "cpus": os.cpu_count(), "python": platform.python_version()},
        "versions": _versions(),
        "command": shlex.join(sys.argv),
    }


def write_report(path, data, benchmark, *, compact=False):
    """Write ``data`` (a dict) as JSON to ``path`` with :func:`environment`'s keys added; keys
    ``data`` already has are kept, so a report re-written later (``--replot``, ``--merge``) still
    says when and where its runs were made. ``compact``: no indentation, for reports of
    thousands of rows. Returns the written dict."""
    report = {**environment(benchmark), **data}
    with open(path, "w") as fh:
        if compact:
            json.dump(report, fh, separators=(",", ":"))
        else:
            json.dump(report, fh, indent=1)
    return report
