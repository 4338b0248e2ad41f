"""float16/bfloat16 all-reduce sums: the compiled operation is exactly NumPy's addition.

The compiled functions are called directly on buffers (no MPI) over every float16/bfloat16 bit
pattern against special values and over random pairs; the MPI routes (compiled, native, Python
and the fallback without Numba) are checked under mpirun by ``mpi_scripts/half_allreduce.py``.
"""
import ctypes
import re
import subprocess
import sys

import numpy as np
import pytest

from pacmpi import half_sum

from mpi_util import run_mpi

ml_dtypes = pytest.importorskip("ml_dtypes")

ROUTES = ("numba cfunc", "native MPI_C_FLOAT16", "python")
FLOAT16_SPECIALS = [0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x03FF, 0x83FF, 0x0400, 0x8400,
                    0x07FF, 0x3BFF, 0x3C00, 0x3C01, 0xBC00, 0xBC01, 0x3800, 0x1000, 0x6800,
                    0x7800, 0x7BFE, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7C01, 0x7DFF, 0x7E00,
                    0xFE00, 0xFFFF, 0x5BFF, 0xDBFF, 0x0C00]
BFLOAT16_SPECIALS = [0x0000, 0x8000, 0x0001, 0x8001, 0x0002, 0x007F, 0x807F, 0x0080, 0x8080,
                     0x3F7F, 0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x3F00, 0x7F7E, 0x7F7F, 0xFF7F,
                     0x7F80, 0xFF80, 0x7F81, 0x7FBF, 0x7FC0, 0xFFC0, 0xFFFF, 0x4B80, 0xCB80,
                     0x3380]


def dtype_of(name):
    return np.dtype(np.float16) if name == "float16" else np.dtype(ml_dtypes.bfloat16)


def all_pairs(name, seed=0):
    """Every bit pattern against each special value (both operand orders), plus random pairs."""
    special = np.array(FLOAT16_SPECIALS if name == "float16" else BFLOAT16_SPECIALS, np.uint16)
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    rng = np.random.default_rng(seed)
    rand_a = rng.integers(0, 1 << 16, 1 << 20).astype(np.uint16)
    rand_b = rng.integers(0, 1 << 16, 1 << 20).astype(np.uint16)
    a = np.concatenate([np.repeat(special, every.size), np.tile(every, special.size), rand_a])
    b = np.concatenate([np.tile(every, special.size), np.repeat(special, every.size), rand_b])
    return a, b


def reference(name, invec, inoutvec):
    """``inout + in`` by NumPy (float16) or ml_dtypes (bfloat16), and by the definition."""
    dtype = dtype_of(name)
    with np.errstate(all="ignore"):
        by_numpy = (inoutvec.view(dtype) + invec.view(dtype)).view(np.uint16)
        by_definition = (inoutvec.view(dtype).astype(np.float32) +
                         invec.view(dtype).astype(np.float32)).astype(dtype).view(np.uint16)
    return by_numpy, by_definition


def assert_same_sums(name, got, want):
    dtype = dtype_of(name)
    want_nan = np.isnan(want.view(dtype).astype(np.float32))
    got_nan = np.isnan(got.view(dtype).astype(np.float32))
    np.testing.assert_array_equal(got_nan, want_nan)  # NaN exactly where NumPy has NaN
    bad = np.flatnonzero(got[~want_nan] != want[~want_nan])  # every other result, bit for bit
    assert bad.size == 0, [(hex(g), hex(w)) for g, w in
                           zip(got[~want_nan][bad[:5]], want[~want_nan][bad[:5]])]


def call(function, invec, inoutvec):
    """Run a compiled MPI_User_function on two uint16 views of one length, without MPI."""
    assert invec.dtype == inoutvec.dtype == np.uint16 and invec.size == inoutvec.size
    assert invec.flags.c_contiguous and inoutvec.flags.c_contiguous
    length = ctypes.c_int32(invec.size)
    function.ctypes(invec.ctypes.data, inoutvec.ctypes.data, ctypes.byref(length), None)


@pytest.fixture(scope="module")
def kernels():
    """dtype name -> compiled sum, by conversion route: bit manipulation (what CPUs without
    half<->float instructions run) and, where this CPU has them, hardware."""
    pytest.importorskip("numba")
    from pacmpi.kernels.cpu import half_sum_function, hardware_half_conversions
    names = ("float16", "bfloat16")
    variants = {False: {name: half_sum_function(name, soft=True) for name in names}}
    if hardware_half_conversions():
        variants[True] = {name: half_sum_function(name) for name in names}
    return variants


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("hardware", [False, True], ids=["bit-ops", "hardware"])
def test_compiled_sum_is_numpys_addition(kernels, name, hardware):
    if hardware not in kernels:
        pytest.skip("the CPU has no half<->float conversion instructions")
    a, b = all_pairs(name)
    by_numpy, by_definition = reference(name, a, b)
    assert_same_sums(name, by_definition, by_numpy)  # the definition the kernels implement
    got = b.copy()
    call(kernels[hardware][name], a, got)
    assert_same_sums(name, got, by_numpy)


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
def test_compiled_sum_special_cases(kernels, name):
    dtype = dtype_of(name)
    kernel = kernels[max(kernels)][name]
    big = float(ml_dtypes.finfo(dtype).max if name == "bfloat16" else np.finfo(dtype).max)
    tiny = float(ml_dtypes.finfo(dtype).smallest_subnormal if name == "bfloat16"
                 else np.finfo(dtype).smallest_subnormal)
    cases = [  # inout, in, expected
        (-0.0, -0.0, -0.0), (0.0, -0.0, 0.0), (np.inf, 1.0, np.inf), (np.inf, -np.inf, np.nan),
        (big, big, np.inf), (tiny, tiny, 2 * tiny), (tiny, -tiny, 0.0), (1.0, 2.0, 3.0),
        (np.nan, 1.0, np.nan), (-np.inf, -np.inf, -np.inf)]
    inout = np.array([c[0] for c in cases], dtype=dtype)
    inp = np.array([c[1] for c in cases], dtype=dtype)
    call(kernel, inp.view(np.uint16), inout.view(np.uint16))
    got = inout.astype(np.float64)
    want = np.array([c[2] for c in cases], dtype=np.float64)
    np.testing.assert_array_equal(got, want)
    numbers = ~np.isnan(want)  # a NaN's sign is not specified (x86's default NaN is negative)
    np.testing.assert_array_equal(np.signbit(got[numbers]), np.signbit(want[numbers]))


def test_route_choice_is_validated(monkeypatch):
    monkeypatch.setenv(half_sum.HALF_SUM_ENV, "fast")
    with pytest.raises(ValueError, match="PACMPI_HALF_SUM='fast'"):
        half_sum._choice()
    for choice in ("", "auto", "Numba", "native", "python"):
        monkeypatch.setenv(half_sum.HALF_SUM_ENV, choice)
        assert half_sum._choice() == (choice.lower() or "auto")


def test_importing_pacmpi_loads_neither_numba_nor_mpi():
    code = ("import sys, pacmpi, pacmpi.collectives, pacmpi.half_sum; "
            "assert 'numba' not in sys.modules and 'mpi4py.MPI' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------- under mpirun
def routes_of(stdout, n):
    routes = re.findall(r"^HALF-OK (.+)$", stdout, re.M)
    assert len(routes) == n, stdout
    assert len(set(routes)) == 1, routes
    return routes[0]


@pytest.mark.mpi
@pytest.mark.parametrize("n", [2, 4])
def test_allreduce_sums_half_precision(n):
    result = run_mpi("half_allreduce.py", n, "check", timeout=180)
    assert result.returncode == 0, result.stderr
    route = routes_of(result.stdout, n)
    try:
        import numba  # noqa: F401
        assert route == "numba cfunc", (route, result.stderr)
        assert "pacmpi:" not in result.stderr  # the preferred route needs no note
    except ImportError:
        assert route.startswith("float16: ") or route == "python", route


@pytest.mark.mpi
@pytest.mark.parametrize("choice", ["python", "native"])
def test_allreduce_sums_half_precision_on_other_routes(choice):
    result = run_mpi("half_allreduce.py", 2, "check", timeout=180,
                     env={"PACMPI_HALF_SUM": choice})
    assert result.returncode == 0, result.stderr
    route = routes_of(result.stdout, 2)
    if choice == "python":
        assert route == "python"
    else:
        # bfloat16 has no native MPI type here: it falls back to Python, saying so once.
        assert route in ("float16: native MPI_C_FLOAT16, bfloat16: python", "python"), route
        assert result.stderr.count("pacmpi: bfloat16 all-reduce sums use the python route") == 1


@pytest.mark.mpi
def test_without_numba_falls_back_with_a_note():
    result = run_mpi("half_allreduce.py", 2, "check", "nonumba", timeout=180)
    assert result.returncode == 0, result.stderr
    route = routes_of(result.stdout, 2)
    assert route in ("float16: native MPI_C_FLOAT16, bfloat16: python", "python"), route
    notes = [line for line in result.stderr.splitlines() if line.startswith("pacmpi: ")]
    assert len(notes) == 2, result.stderr  # one line per dtype, on rank 0 only
    assert all("(numba: ModuleNotFoundError" in note for note in notes), notes


@pytest.mark.mpi
def test_half_benchmark_runs():
    # Timing is not asserted here (shared 2-core machines are noisy); run it as
    # mpirun -n 4 python tests/mpi_scripts/half_allreduce.py bench 32 5 to measure.
    result = run_mpi("half_allreduce.py", 2, "bench", 1, 2, timeout=180)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^BENCH float16 \(.+\) 1 MiB: min [\d.]+ ms", result.stdout, re.M), \
        result.stdout
    assert re.search(r"^BENCH float32 \(MPI_FLOAT\) 2 MiB", result.stdout, re.M), result.stdout
