"""float16/bfloat16 all-reduce sums through MPICollectives, checked or timed on every rank.

Usage: half_allreduce.py check [nonumba]
       half_allreduce.py bench SIZE_MIB ITERS

The route is the one ``pacmpi.half_sum`` picks (``PACMPI_HALF_SUM`` steers it); ``nonumba``
hides Numba, as on an installation without it. ``check`` prints ``HALF-OK <route>`` on every
rank once every check passed; ``bench`` prints, on rank 0, ``BENCH <label> <size> MiB: min X
ms, median Y ms`` for a float16 and a float32 all-reduce of SIZE_MIB MiB each.
"""
import sys
import time

if "nonumba" in sys.argv[2:]:
    sys.modules["numba"] = None  # an installation without Numba

import numpy as np
from mpi4py import MPI

from pacmpi import faults
from pacmpi.arrays import bfloat16_dtype
from pacmpi.collectives import MPICollectives
from pacmpi.half_sum import _results_agree, _self_test_pairs, half_dtypes, half_sum, half_sum_route

faults.install_excepthook()  # a failed check on one rank ends the job instead of hanging it
MODE = sys.argv[1]
collectives = MPICollectives()
rank, size = collectives.rank, collectives.size


def finfo(dtype):
    if np.dtype(dtype).name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def check(dtype):
    name = np.dtype(dtype).name
    # 1. The op itself, locally, on bit patterns with every kind of special value.
    half = half_sum(MPI, dtype)
    a, b = _self_test_pairs(np.dtype(dtype))
    got = b.copy()
    half.op.Reduce_local([a, a.size, half.datatype], [got, got.size, half.datatype])
    assert _results_agree(np.dtype(dtype), a, b, got), f"{name}: Reduce_local"

    # 2. Small integers: every partial sum is exact in any order, so the result is exact.
    #    Several lengths, including ones MPI splits into segments and the empty buffer.
    for count in (0, 1, 7, 1000, (1 << 20) + 3):
        rng = np.random.default_rng(1000 * count + rank)
        ints = rng.integers(-60, 61, count)
        want = np.asarray(collectives.comm.allreduce(ints, op=MPI.SUM), dtype=np.float64)
        buf = ints.astype(dtype)
        collectives.allreduce(buf, "sum")
        assert np.array_equal(buf.astype(np.float64), want), f"{name} n={count}: exact sum"
        buf = ints.astype(dtype)
        collectives.iallreduce(buf, "sum").wait()
        assert np.array_equal(buf.astype(np.float64), want), f"{name} n={count}: iallreduce"

    # 3. Random values: within the rounding error of size - 1 additions.
    values = np.random.default_rng(7 + rank).standard_normal(100_003).astype(dtype)
    parts = collectives.comm.allgather(values.astype(np.float64))
    exact = np.sum(parts, axis=0)
    magnitude = np.sum(np.abs(parts), axis=0)
    buf = values.copy()
    collectives.allreduce(buf, "sum")
    eps = float(finfo(dtype).eps)
    error = np.abs(buf.astype(np.float64) - exact)
    assert np.all(error <= (size - 1) * eps * magnitude + 1e-30), f"{name}: random sums"

    # 4. Special values: inf, inf - inf, NaN, -0, overflow to inf.
    big = float(finfo(dtype).max)
    row = np.array([np.inf if rank == 0 else 1.0,
                    np.inf if rank == 0 else (-np.inf if rank == 1 else 0.0),
                    np.nan if rank == size - 1 else 2.0,
                    -0.0,
                    big,
                    0.0 if rank else -0.0]).astype(dtype)
    collectives.allreduce(row, "sum")
    out = row.astype(np.float64)
    assert out[0] == np.inf and np.isnan(out[1]) and np.isnan(out[2]), f"{name}: {out}"
    assert out[3] == 0 and np.signbit(out[3]), f"{name}: -0 + -0 must stay -0"
    assert out[4] == np.inf, f"{name}: overflow must give inf"
    assert out[5] == 0 and not np.signbit(out[5]), f"{name}: -0 + 0 must be +0"


if MODE == "check":
    dtypes = half_dtypes()
    assert bfloat16_dtype() is None or len(dtypes) == 2
    for dtype in dtypes:
        check(dtype)
    route = half_sum_route()
    routes = collectives.allgather_object(route)
    assert len(set(routes)) == 1, routes
    print(f"HALF-OK {route}", flush=True)
elif MODE == "bench":
    mib, iters = float(sys.argv[2]), int(sys.argv[3])
    count = int(mib * (1 << 20)) // 2
    for label, dtype, n in (("float16", np.float16, count), ("float32", np.float32, count)):
        buf = np.ones(n, dtype=dtype)
        times = []
        for i in range(iters + 1):
            buf[...] = 1
            collectives.comm.Barrier()
            start = time.perf_counter()
            collectives.allreduce(buf, "sum")
            times.append(time.perf_counter() - start)
        assert buf[0] == size, buf[:4]
        slowest = np.array(times[1:])  # the first call is a warm-up
        collectives.allreduce(slowest, "max")
        if rank == 0:
            route = half_sum_route("float16") if dtype == np.float16 else "MPI_FLOAT"
            print(f"BENCH {label} ({route}) {n * np.dtype(dtype).itemsize / 2**20:g} MiB: "
                  f"min {slowest.min() * 1e3:.1f} ms, median {np.median(slowest) * 1e3:.1f} ms",
                  flush=True)
else:
    raise SystemExit(f"unknown mode {MODE!r}")
