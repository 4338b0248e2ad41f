"""The MPI sum of float16 and bfloat16 buffers: which route sums them, chosen once per process.

MPI has no portable half-precision SUM. Three routes, tried in this order unless the
environment variable PACMPI_HALF_SUM (auto|numba|native|python) names one to try first
(then "python"); a route not taken is reported in one line on rank 0:

- "numba cfunc": a compiled MPI_User_function over 16-bit words (MPI_UINT16_T), built from the
  kernels' own conversions (:func:`pacmpi.kernels.cpu.half_sum_function`) and registered
  through the MPI library's own ``MPI_Op_create``;
- native: the MPI library's half type with MPI_SUM (Open MPI 5's MPIX_C_FLOAT16, exposed by
  mpi4py as FLOAT16_T), when it exists and sums correctly;
- "python": an mpi4py ``Op.Create`` around NumPy's in-place add.

32 MiB of float16 over 4 ranks on 2 cores: numba ~30 ms (float32, twice the bytes: ~66 ms),
python ~110 ms, native ~350 ms (the PyPI Open MPI 5.0 converts _Float16 in software).
Every route gives, per pair, exactly NumPy's float16 add, float16(float32(a) + float32(b))
(ml_dtypes' for bfloat16): round to nearest even, inf, subnormals and -0 included; only NaN
payloads may differ. A route other than "python" is checked against NumPy on special values
before it is used. Every rank must take the same route (they do with the same software): the
native route's datatype differs from the others'.
"""
import os
import sys
import threading

import numpy as np

from . import _libmpi
from .arrays import bfloat16_dtype

__all__ = ["half_sum_route"]

HALF_SUM_ENV = "PACMPI_HALF_SUM"
HALF_SUM_ROUTES = ("numba", "native", "python")
_LOCK = threading.Lock()
_SUMS = {}  # dtype -> HalfSum: how this process sums it


class HalfSum:
    """How one half dtype is summed: MPI datatype, MPI op, route name, and what must outlive
    the op (the compiled function or Python callable it calls)."""

    def __init__(self, datatype, op, route, keep=None):
        self.datatype, self.op, self.route, self.keep = datatype, op, route, keep


def half_dtypes():
    """float16, and bfloat16 when ml_dtypes is installed."""
    bf16 = bfloat16_dtype()
    return (np.dtype(np.float16),) if bf16 is None else (np.dtype(np.float16), bf16)


def is_half(dtype):
    """Whether ``dtype`` is one of :func:`half_dtypes`, without importing ml_dtypes: an array
    of its bfloat16 exists only once it is loaded, and loading it costs every process that
    never sees one about a second (a training job's broadcasts ask this of float32)."""
    dtype = np.dtype(dtype)
    return dtype == np.float16 or dtype.name == "bfloat16"


def _numba_half_sum(MPI, dtype):
    from .kernels.cpu import half_sum_function  # imports Numba: only when this route is tried

    function = half_sum_function(dtype.name)
    return HalfSum(MPI.UINT16_T, _libmpi.user_op(MPI, function.address), "numba cfunc",
                   keep=function)


def _native_half_sum(MPI, dtype):
    name = "FLOAT16_T" if dtype == np.float16 else "BFLOAT16_T"
    datatype = getattr(MPI, name, None)
    if datatype is None or datatype == MPI.DATATYPE_NULL:
        raise RuntimeError(f"this MPI library has no {name}")
    route = "native MPI_C_FLOAT16" if dtype == np.float16 else f"native MPI_{name}"
    return HalfSum(datatype, MPI.SUM, route)


def _python_half_sum(MPI, dtype):
    def _sum(inbuf, inoutbuf, datatype, _dtype=dtype):
        acc = np.frombuffer(inoutbuf, dtype=_dtype)
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are valid sums
            acc += np.frombuffer(inbuf, dtype=_dtype)

    return HalfSum(MPI.UINT16_T, MPI.Op.Create(_sum, commute=True), "python", keep=_sum)


_BUILDERS = {"numba": _numba_half_sum, "native": _native_half_sum, "python": _python_half_sum}


def _self_test_pairs(dtype):
    """Bit patterns that exercise rounding, subnormals, overflow, inf, NaN and signed zero."""
    if dtype == np.float16:
        special = [0x0000, 0x8000, 0x0001, 0x8001, 0x03FF, 0x0400, 0x3C00, 0x3C01, 0xBC00,
                   0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0x1400, 0x0C00]
    else:
        special = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x3F80, 0x3F81, 0xBF80,
                   0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x3B80, 0x3380]
    special = np.array(special, dtype=np.uint16)
    rng = np.random.default_rng(12345)
    a = np.concatenate([np.repeat(special, special.size), rng.integers(0, 1 << 16, 512)])
    b = np.concatenate([np.tile(special, special.size), rng.integers(0, 1 << 16, 512)])
    return a.astype(np.uint16), b.astype(np.uint16)


def _results_agree(dtype, a_bits, b_bits, got_bits):
    """``got == b + a`` in ``dtype`` (NumPy/ml_dtypes), bit for bit except NaN payloads."""
    with np.errstate(all="ignore"):
        want = (b_bits.view(dtype) + a_bits.view(dtype)).view(np.uint16)
    want_nan = np.isnan(want.view(dtype).astype(np.float32))
    got_nan = np.isnan(got_bits.view(dtype).astype(np.float32))
    return bool(np.array_equal(want_nan, got_nan) and
                np.array_equal(want[~want_nan], got_bits[~want_nan]))


def _self_test(MPI, dtype, half):
    """Sum the self-test pairs through ``MPI_Reduce_local`` with ``half``; raise if wrong."""
    a, b = _self_test_pairs(dtype)
    got = b.copy()
    half.op.Reduce_local([a, a.size, half.datatype], [got, got.size, half.datatype])
    if not _results_agree(dtype, a, b, got):
        raise RuntimeError(f"wrong {dtype} sums through MPI_Reduce_local")


def _choice():
    choice = os.environ.get(HALF_SUM_ENV, "").strip().lower() or "auto"
    if choice != "auto" and choice not in HALF_SUM_ROUTES:
        raise ValueError(f"{HALF_SUM_ENV}={choice!r}: use auto, " + ", ".join(HALF_SUM_ROUTES))
    return choice


def half_sum(MPI, dtype):
    """The process-wide :class:`HalfSum` for ``dtype``, chosen and self-tested on first use.

    MPI allows only a few user-defined operations per process: one per dtype, shared.
    """
    dtype = np.dtype(dtype)
    found = _SUMS.get(dtype)
    if found is None:
        with _LOCK:  # looked up again under the lock: one thread chooses, the others wait
            found = _SUMS.get(dtype)
            if found is None:
                found = _SUMS[dtype] = _choose(MPI, dtype)
    return found


def _choose(MPI, dtype):
    """The first route that builds and passes its self-test; says on rank 0 why others did
    not."""
    choice = _choice()
    routes = HALF_SUM_ROUTES if choice == "auto" else (choice, "python")
    failures = []
    for route in routes:
        try:
            found = _BUILDERS[route](MPI, dtype)
            if route != "python":
                _self_test(MPI, dtype, found)
            break
        except Exception as exc:  # noqa: BLE001 - try the next route, say why below
            failures.append(f"{route}: {type(exc).__name__}: {exc}")
    else:  # even the Python operation failed: MPI itself is unusable
        raise RuntimeError(f"no way to sum {dtype} over MPI: " + "; ".join(failures))
    if failures and MPI.COMM_WORLD.Get_rank() == 0:
        print(f"pacmpi: {dtype} all-reduce sums use the {found.route} route ({failures[0]})",
              file=sys.stderr, flush=True)
    return found


def half_sum_route(dtype=None):
    """How this process sums float16/bfloat16 in all-reduces: ``"numba cfunc"`` (compiled
    user op), ``"native MPI_C_FLOAT16"`` (the MPI library's half type) or ``"python"``.

    With ``dtype=None``, both half dtypes (bfloat16 when ml_dtypes is installed); should they
    differ, ``"float16: ..., bfloat16: ..."``. Initializes MPI (through mpi4py) if needed.
    """
    from mpi4py import MPI

    dtypes = half_dtypes() if dtype is None else (np.dtype(dtype),)
    for d in dtypes:
        if not is_half(d):
            raise ValueError(f"{d} is not a half-precision dtype")
    routes = {d.name: half_sum(MPI, d).route for d in dtypes}
    if len(set(routes.values())) == 1:
        return next(iter(routes.values()))
    return ", ".join(f"{name}: {route}" for name, route in routes.items())
