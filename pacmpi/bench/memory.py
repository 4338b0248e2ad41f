"""``pacmpi bench memory``: measure the memory pacmpi's reducer adds per rank, by component, for
each quantize mode and mask density; rank 0 prints a table of ratios to the gradient's bytes and
``--json`` writes it.

For each quantize mode and mask density the reducer runs a few steps on one gradient of
``--elements`` float32 values (one bucket, a view of the gradient: no fusion buffer) under a
random mask. Reported per rank, each as a ratio of the gradient's bytes:

- the arrays the reducer keeps between steps, read from the live arrays
  (:meth:`pacmpi.PacTrainReducer.memory_report`): survivor ``indices``, mask ``snapshots``,
  ``payloads`` (packed survivors), ternary ``words``, error-feedback ``residuals`` (ternary runs
  with error feedback on, its largest case), ``fusion``
  buffers; ``kept`` is their sum;
- ``peak``: the largest NumPy allocation above what existed before the reducer was built
  (tracemalloc), temporaries included;
- ``rss``: the peak resident memory above the same starting point (Linux ``VmHWM``, reset
  through ``/proc/self/clear_refs``), less that of the same steps of a plain in-place
  all-reduce of the gradient: the MPI library's own scratch (Open MPI's all-reduce takes about
  half the message per call), which any all-reduce of it pays, is not pacmpi's.

The DDP hook and the Horovod compressor are measured by ``pacmpi bench hook`` (they need torch),
with the same components and columns (:func:`format_table`).
"""
import ctypes
import ctypes.util
import functools
import gc
import os
import tracemalloc

import numpy as np

from .. import kernels
from ..cli_options import add_densities, add_json_file, command_parser
from ..engine import MEMORY_COMPONENTS
from ..units import parse_size
from . import harness

__all__ = ["COMPONENTS", "ResidentPeak", "fixed_mmap_threshold", "run", "format_table", "main"]

COMPONENTS = MEMORY_COMPONENTS + ("fusion",)
MODES = {"lossless": None, "fp16": "fp16", "ternary": "ternary"}


def _status_kib(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


@functools.cache
def fixed_mmap_threshold():
    """Large blocks from their own mappings, returned to the system when freed: glibc's default
    raises its threshold after the first such free, keeping later arrays' pages resident after
    they are freed, which would hide them from the next measurement's peak.

    Once per process, and best before any other thread starts: ``mallopt`` is not thread-safe
    (glibc marks it MT-Unsafe). Called again at every measurement while the DDP benchmark's
    gloo threads allocated, it crashed about 1 run in 10 with a segmentation fault in one of
    them."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD: a fixed value turns the raising off
    except (OSError, AttributeError):
        pass


class ResidentPeak:
    """Peak resident memory (bytes) above the moment :meth:`start` was called, and the peak
    of NumPy allocations (tracemalloc) above the same moment. Linux only (``/proc``); where
    the peak cannot be reset, ``rss`` is None."""

    def start(self):
        fixed_mmap_threshold()
        gc.collect()
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")  # resets VmHWM to the current VmRSS
            self._rss = _status_kib("VmRSS")
        except OSError:
            self._rss = None
        if not tracemalloc.is_tracing():
            tracemalloc.start()
        tracemalloc.reset_peak()
        self._traced = tracemalloc.get_traced_memory()[0]
        return self

    def stop(self):
        """``{"peak": bytes, "rss": bytes or None}``. Tracing stays on: stopping it while
        another thread allocates raw memory without the GIL (a transport's thread taking the GIL
        for a callback) frees the tables that thread is writing (CPython gh-128679, fixed
        after 3.11): ``pacmpi bench hook`` crashed with a segmentation fault in 1 run of 4-10.
        Tracing slows every later allocation (the hook's own time read 2.5-3.9x at 400 tensors
        with it on), so time afterwards in another process, or before the first ``start``."""
        peak = tracemalloc.get_traced_memory()[1] - self._traced
        rss = None if self._rss is None else (_status_kib("VmHWM") - self._rss) * 1024
        return {"peak": peak, "rss": rss}


def random_mask(size, density, seed):
    """A flat bool mask keeping ``round(density * size)`` random coordinates."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(size, dtype=bool)
    mask[rng.permutation(size)[:round(density * size)]] = True
    return mask


def ratio_row(report, grad_bytes, peaks, **labels):
    """A table row: ``labels``, each component's bytes as a ratio of ``grad_bytes``, ``kept``
    (their sum), and ``peaks`` (:meth:`ResidentPeak.stop`) the same way."""
    row = dict(labels, grad_bytes=grad_bytes)
    row.update({c: report.get(c, 0) / grad_bytes for c in COMPONENTS})
    row["kept"] = sum(report.values()) / grad_bytes
    row.update({k: None if v is None else v / grad_bytes for k, v in peaks.items()})
    return row


def _measure(elements, density, mode, steps, comm):
    from ..reducer import PacTrainReducer

    rng = np.random.default_rng(0)
    pristine = rng.standard_normal(elements, dtype=np.float32)
    grads = [pristine.copy()]
    masks = [random_mask(elements, density, seed=1)]
    peak = ResidentPeak().start()
    # Ternary with error feedback (off by default): the residuals are its largest cost.
    reducer = PacTrainReducer(masks, comm=comm, quantize=MODES[mode],
                              error_feedback=MODES[mode] == "ternary", bucket_bytes=elements * 4)
    for _ in range(steps):
        np.copyto(grads[0], pristine)
        reducer.reduce(grads)
    peaks = peak.stop()
    row = ratio_row(reducer.memory_report(), pristine.nbytes, peaks, frontend="reducer",
                    mode=mode, density=density)
    del reducer
    return row


def _plain(elements, steps, comm):
    """Peak resident memory of ``steps`` plain in-place SUM all-reduces of the gradient."""
    from mpi4py import MPI
    grad = np.random.default_rng(0).standard_normal(elements, dtype=np.float32)
    peak = ResidentPeak().start()
    for _ in range(steps):
        comm.Allreduce(MPI.IN_PLACE, grad, op=MPI.SUM)
    return peak.stop()["rss"]


def run(elements=1 << 22, densities=(1.0, 0.5, 0.2), modes=("lossless", "ternary"), steps=3,
        comm=None):
    """Rows of :func:`ratio_row` for the reducer, each rank's largest number (MAX over
    ranks)."""
    from mpi4py import MPI

    comm = comm or MPI.COMM_WORLD
    kernels.warm_up([np.float32])  # compile (or load) the kernels: not a step's memory
    for mode in modes:  # import lazily what a step needs
        _measure(4096, 0.5, mode, 2, comm)
    rows, plain = [], _plain(elements, steps, comm)
    for mode in modes:
        for density in densities:
            row = _measure(elements, density, mode, steps, comm)
            if row["rss"] is not None and plain is not None:
                row["rss"] -= plain / (elements * 4)
            for key in COMPONENTS + ("kept", "peak", "rss"):
                if row[key] is not None:
                    row[key] = comm.allreduce(row[key], op=MPI.MAX)
            rows.append(row)
    return rows


def format_table(rows):
    """The rows as text: one column per component, ratios of the gradient bytes."""
    columns = [("frontend", "frontend", "<8"), ("mode", "mode", "<8"),
               ("density", "density", ">7.2f")]
    columns += [(c, c, ">9.3f") for c in COMPONENTS + ("kept", "peak", "rss")]
    return harness.format_table(rows, columns)


def build_parser(parser=None):
    parser = parser or command_parser("pacmpi bench memory", __doc__)
    parser.add_argument("--elements", type=parse_size, default=1 << 22, metavar="N",
                        help="float32 values in the gradient, K/M/G binary (default 4M; 32M is "
                             "128 MiB)")
    add_densities(parser, "1.0,0.5,0.2")
    parser.add_argument("--modes", default="lossless,ternary", metavar="MODE,MODE",
                        help=f"quantize modes, comma-separated, from {', '.join(sorted(MODES))}")
    parser.add_argument("--steps", type=int, default=3, metavar="N",
                        help="reducer steps per measurement (the memory is read after them)")
    add_json_file(parser, "the report")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    fixed_mmap_threshold()  # before MPI starts its threads
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"pacmpi bench memory: unknown modes {bad}; choose from {sorted(MODES)}")
    from mpi4py import MPI

    rows = run(args.elements, [float(d) for d in args.densities.split(",")], modes,
               args.steps)
    if MPI.COMM_WORLD.rank == 0:
        print(f"pacmpi's memory per rank as a ratio of the gradient bytes "
              f"({args.elements} float32 values, {MPI.COMM_WORLD.size} ranks, pid {os.getpid()})")
        print(format_table(rows))
        if args.json:
            harness.write_report(args.json, {"rows": rows, "ranks": MPI.COMM_WORLD.size},
                                 "pacmpi bench memory")
    return 0
