"""The small collective interface pacmpi needs, and its mpi4py implementation.

Adapters can plug in another transport (Horovod's) by implementing :class:`Collectives`; the
reducer then reuses packing, tracking, verification and quantization unchanged.
"""
import os
import sys
import threading

import numpy as np

from .arrays import array_module, bfloat16_dtype, is_device_array, synchronize

__all__ = ["Collectives", "MPICollectives", "CompletedRequest", "default_collectives",
           "half_sum_route"]


_HALF_SUM_OPS = {}  # dtype -> _HalfSum: how this process sums it (see half_sum_route)


class CompletedRequest:
    """A request that is already complete (for blocking transports)."""

    def wait(self):
        return None


class Collectives:
    """Interface: in-place reductions on NumPy/CuPy arrays plus two control-plane helpers.

    Every method is collective: all ranks call it in the same order with the same sizes.
    """

    rank = 0
    size = 1

    word_dtypes = ("int64", "int32")
    """Integer types this transport can SUM: the ternary codec's word types."""

    def allreduce(self, buf, op="sum", name=None):
        """Reduce ``buf`` in place over all ranks; ``op`` is ``"sum"`` or ``"max"``.

        ``name`` identifies the collective for transports that match calls by name (Horovod);
        others ignore it."""
        raise NotImplementedError

    def iallreduce(self, buf, op="sum", name=None):
        """Start an in-place reduction; return an object whose ``wait()`` completes it."""
        self.allreduce(buf, op, name=name)
        return CompletedRequest()

    def bcast(self, buf, root=0, name=None):
        """Broadcast ``buf`` in place from ``root``."""
        raise NotImplementedError

    def reduce(self, buf, op="sum", root=0, name=None):
        """Reduce ``buf`` into ``root``'s ``buf`` in place; the other ranks' ``buf`` is only
        read."""
        raise NotImplementedError

    def allgather_object(self, obj, name=None):
        """Gather one picklable object from every rank, in rank order, on every rank."""
        raise NotImplementedError


class _MPIRequest:
    """An MPI request; ``watch`` is the stall watchdog's context for its wait, or ``None``."""

    def __init__(self, request, watch=None):
        self._request, self._watch = request, watch

    def wait(self):
        if self._watch is None:
            self._request.Wait()
        else:
            with self._watch:
                self._request.Wait()


class _StagedRequest(_MPIRequest):
    """Completes a host-staged reduction by copying the result back to the device."""

    def __init__(self, request, watch, host, device):
        super().__init__(request, watch)
        self._host, self._device = host, device

    def wait(self):
        super().wait()
        self._device.set(self._host)


def _half_dtypes():
    bf16 = bfloat16_dtype()
    return (np.dtype(np.float16),) if bf16 is None else (np.dtype(np.float16), bf16)


# ------------------------------------------------------------------ float16/bfloat16 sums
# MPI has no portable half-precision SUM. Three routes, tried in this order unless the
# environment variable PACMPI_HALF_SUM (auto|numba|native|python) names one to try first
# (then "python"); a route not taken is reported in one line on rank 0:
#   "numba cfunc": a compiled MPI_User_function, registered through the MPI library's own
#       MPI_Op_create (ctypes), over 16-bit words (MPI_UINT16_T);
#   native: the MPI library's half type with MPI_SUM (Open MPI 5's MPIX_C_FLOAT16, exposed by
#       mpi4py as FLOAT16_T), when it exists and sums correctly;
#   "python": an mpi4py Op.Create around NumPy's in-place add.
# 32 MiB of float16 over 4 ranks on 2 cores: numba ~30 ms (float32, twice the bytes: ~66 ms),
# python ~110 ms, native ~350 ms (the PyPI Open MPI 5.0 converts _Float16 in software).
# Every route gives, per pair, exactly numpy's float16 add, float16(float32(a) + float32(b))
# (ml_dtypes' for bfloat16): round to nearest even, inf, subnormals and -0 included; only NaN
# payloads may differ. Every rank must take the same route (they do with the same software):
# the native route's datatype differs from the others'.
HALF_SUM_ENV = "PACMPI_HALF_SUM"
HALF_SUM_ROUTES = ("numba", "native", "python")
_HALF_SUM_LOCK = threading.Lock()
_NUMBA_KERNELS = {}  # hardware flag (None: as the CPU allows) -> kernels or the exception


class _HalfSum:
    """How one half dtype is summed: MPI datatype, MPI op, route name, what keeps it alive."""

    def __init__(self, datatype, op, route, keep=None):
        self.datatype, self.op, self.route, self.keep = datatype, op, route, keep


def _build_numba_half_kernels(hardware=None):
    """Compile the sums as Numba ``@cfunc`` MPI_User_functions.

    Returns ``{"float16": cfunc, "bfloat16": cfunc}``, each with the C signature
    ``void(void *in, void *inout, int *len, MPI_Datatype *type)`` over ``len`` 16-bit words:
    ``inout[i] = round(float32(inout[i]) + float32(in[i]))``. float16 converts through
    LLVM's half type when ``hardware`` (vectorized F16C instructions; ``None``: when the CPU
    has them), else through integer bit manipulation (portable, ~5x slower); both round to
    nearest even exactly as NumPy does.
    """
    import numpy as np
    from llvmlite import ir
    from numba import carray, cfunc, njit, types
    from numba.extending import intrinsic

    from .kernels.cpu import _float_to_half_hardware as f32_to_half_hw
    from .kernels.cpu import _half_to_float_hardware as half_to_f32_hw
    from .kernels.cpu import hardware_half_conversions

    if hardware is None:
        hardware = hardware_half_conversions()
    u32 = np.uint32

    @intrinsic
    def f32_from_bits(typingctx, bits):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

    @intrinsic
    def bits_from_f32(typingctx, value):
        def codegen(context, builder, sig, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    @njit(inline="always")
    def half_to_f32_bits(h):
        h = u32(h)
        em = h & u32(0x7FFF)
        sign = (h & u32(0x8000)) << u32(16)
        normal = (em << u32(13)) + u32(0x38000000)      # rebias the exponent by 127 - 15
        special = (em << u32(13)) + u32(0x70000000)     # inf/NaN: exponent 31 -> 255
        subnormal = bits_from_f32(np.float32(em) * np.float32(2.0 ** -24))  # exact
        bits = subnormal if em < u32(0x400) else (special if em >= u32(0x7C00) else normal)
        return f32_from_bits(bits | sign)

    @njit(inline="always")
    def f32_to_half_bits(x):
        f = bits_from_f32(x)
        sign = (f >> u32(16)) & u32(0x8000)
        a = f & u32(0x7FFFFFFF)
        # NaN: quiet, top payload bits kept (as numpy does).
        nan = u32(0x7E00) | ((a >> u32(13)) & u32(0x3FF))
        # Normal result: rebias, round to nearest even on the bits; a carry into the exponent
        # is right, up to inf for |x| >= 65520.
        normal = (a + u32(0xC8000FFF) + ((a >> u32(13)) & u32(1))) >> u32(13)
        # Subnormal result (|x| < 2**-14): adding 0.5 makes the FPU round to 2**-24 steps.
        subnormal = bits_from_f32(f32_from_bits(a) + np.float32(0.5)) - u32(0x3F000000)
        bits = (subnormal if a < u32(0x38800000) else
                normal if a < u32(0x47800000) else
                u32(0x7C00) if a <= u32(0x7F800000) else nan)
        return np.uint16(bits | sign)

    @njit(inline="always")
    def f32_to_bf16(x):
        f = bits_from_f32(x)
        rounded = (f + u32(0x7FFF) + ((f >> u32(16)) & u32(1))) >> u32(16)
        nan = ((f >> u32(16)) & u32(0x8000)) | u32(0x7FC0)  # ml_dtypes: canonical quiet NaN
        return np.uint16(nan if (f & u32(0x7FFFFFFF)) > u32(0x7F800000) else rounded)

    signature = types.void(types.voidptr, types.voidptr, types.CPointer(types.int32),
                           types.voidptr)

    to_f32, to_half = ((half_to_f32_hw, f32_to_half_hw) if hardware
                       else (half_to_f32_bits, f32_to_half_bits))

    @cfunc(signature)
    def float16_sum(invec, inoutvec, length, datatype):
        n = length[0]
        src = carray(invec, n, dtype=np.uint16)
        acc = carray(inoutvec, n, dtype=np.uint16)
        for i in range(n):
            acc[i] = to_half(to_f32(acc[i]) + to_f32(src[i]))

    @cfunc(signature)
    def bfloat16_sum(invec, inoutvec, length, datatype):
        n = length[0]
        src = carray(invec, n, dtype=np.uint16)
        acc = carray(inoutvec, n, dtype=np.uint16)
        for i in range(n):
            acc[i] = f32_to_bf16(f32_from_bits(u32(acc[i]) << u32(16)) +
                                 f32_from_bits(u32(src[i]) << u32(16)))

    return {"float16": float16_sum, "bfloat16": bfloat16_sum}


def call_half_kernel(kernel, invec, inoutvec):
    """Run a compiled sum on two uint16 views of equal length, without MPI (for tests)."""
    import ctypes

    if invec.dtype != np.uint16 or inoutvec.dtype != np.uint16 or invec.size != inoutvec.size:
        raise ValueError("call_half_kernel takes two uint16 arrays of one length")
    if not (invec.flags.c_contiguous and inoutvec.flags.c_contiguous):
        raise ValueError("call_half_kernel takes contiguous arrays")
    length = ctypes.c_int32(invec.size)
    kernel.ctypes(invec.ctypes.data, inoutvec.ctypes.data, ctypes.byref(length), None)


def _half_self_test_pairs(dtype):
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


def _half_results_agree(dtype, a_bits, b_bits, got_bits):
    """``got == b + a`` in ``dtype`` (NumPy/ml_dtypes), bit for bit except NaN payloads."""
    with np.errstate(all="ignore"):
        want = (b_bits.view(dtype) + a_bits.view(dtype)).view(np.uint16)
    want_nan = np.isnan(want.view(dtype).astype(np.float32))
    got_nan = np.isnan(got_bits.view(dtype).astype(np.float32))
    return bool(np.array_equal(want_nan, got_nan) and
                np.array_equal(want[~want_nan], got_bits[~want_nan]))


def _self_test(MPI, dtype, datatype, op):
    """Sum the self-test pairs through ``MPI_Reduce_local`` with ``op``; raise if wrong."""
    a, b = _half_self_test_pairs(dtype)
    got = b.copy()
    op.Reduce_local([a, a.size, datatype], [got, got.size, datatype])
    if not _half_results_agree(dtype, a, b, got):
        raise RuntimeError(f"wrong {dtype} sums through MPI_Reduce_local")


def _numba_kernels(hardware=None):
    """The compiled kernels, built once per process; raises why they are unavailable."""
    kernels = _NUMBA_KERNELS.get(hardware)
    if kernels is None:
        try:
            kernels = _build_numba_half_kernels(hardware)
        except Exception as exc:  # ImportError (no numba), or LLVM could not compile
            kernels = exc
        _NUMBA_KERNELS[hardware] = kernels
    if isinstance(kernels, Exception):
        raise kernels
    return kernels


def _libmpi_function(MPI, name):
    """``name`` from the MPI library mpi4py runs on, through ctypes.

    Looked up through mpi4py's extension module first: ``dlsym`` on its handle searches the
    libraries it was linked against, so this is the very library mpi4py calls.
    """
    import ctypes
    import ctypes.util

    candidates = [MPI.__file__]
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libmpi") and path not in candidates:
                    candidates.append(path)
    except OSError:
        pass
    candidates.append(ctypes.util.find_library("mpi"))
    for candidate in candidates:
        if not candidate:
            continue
        try:
            return getattr(ctypes.CDLL(candidate), name)
        except (OSError, AttributeError):
            continue
    raise RuntimeError(f"{name} not found in the MPI library mpi4py uses")


def _op_from_c_function(MPI, address):
    """An mpi4py ``Op`` for the MPI_User_function at ``address`` (commutative)."""
    import ctypes

    op_create = _libmpi_function(MPI, "MPI_Op_create")
    handle_type = {8: ctypes.c_void_p, 4: ctypes.c_int}.get(MPI._sizeof(MPI.Op))
    if handle_type is None:
        raise RuntimeError(f"unexpected MPI_Op size {MPI._sizeof(MPI.Op)}")
    op_create.restype = ctypes.c_int
    op_create.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(handle_type)]
    handle = handle_type()
    err = op_create(ctypes.c_void_p(address), 1, ctypes.byref(handle))
    if err != 0:
        raise RuntimeError(f"MPI_Op_create failed with error {err}")
    return MPI.Op.fromhandle(handle.value or 0)


def _numba_half_sum(MPI, dtype):
    kernel = _numba_kernels()[dtype.name]
    op = _op_from_c_function(MPI, kernel.address)
    return _HalfSum(MPI.UINT16_T, op, "numba cfunc", keep=kernel)


def _native_half_sum(MPI, dtype):
    name = "FLOAT16_T" if dtype == np.float16 else "BFLOAT16_T"
    datatype = getattr(MPI, name, None)
    if datatype is None or datatype == MPI.DATATYPE_NULL:
        raise RuntimeError(f"this MPI library has no {name}")
    route = "native MPI_C_FLOAT16" if dtype == np.float16 else f"native MPI_{name}"
    return _HalfSum(datatype, MPI.SUM, route)


def _python_half_sum(MPI, dtype):
    def _sum(inbuf, inoutbuf, datatype, _dtype=dtype):
        acc = np.frombuffer(inoutbuf, dtype=_dtype)
        with np.errstate(over="ignore", invalid="ignore"):  # inf and NaN are valid sums
            acc += np.frombuffer(inbuf, dtype=_dtype)

    return _HalfSum(MPI.UINT16_T, MPI.Op.Create(_sum, commute=True), "python", keep=_sum)


_HALF_SUM_BUILDERS = {"numba": _numba_half_sum, "native": _native_half_sum,
                      "python": _python_half_sum}


def _half_sum_choice():
    choice = os.environ.get(HALF_SUM_ENV, "").strip().lower() or "auto"
    if choice != "auto" and choice not in HALF_SUM_ROUTES:
        raise ValueError(f"{HALF_SUM_ENV}={choice!r}: use auto, " + ", ".join(HALF_SUM_ROUTES))
    return choice


def _half_sum(MPI, dtype):
    """The process-wide :class:`_HalfSum` for ``dtype``, chosen and self-tested on first use.

    MPI allows only a few user-defined operations per process: one per dtype, shared.
    """
    dtype = np.dtype(dtype)
    found = _HALF_SUM_OPS.get(dtype)
    if found is not None:
        return found
    with _HALF_SUM_LOCK:
        found = _HALF_SUM_OPS.get(dtype)
        if found is not None:
            return found
        choice = _half_sum_choice()
        routes = HALF_SUM_ROUTES if choice == "auto" else (choice, "python")
        failures = []
        for route in routes:
            try:
                found = _HALF_SUM_BUILDERS[route](MPI, dtype)
                if route != "python":
                    _self_test(MPI, dtype, found.datatype, found.op)
                break
            except Exception as exc:  # noqa: BLE001 - try the next route, say why below
                failures.append(f"{route}: {type(exc).__name__}: {exc}")
                found = None
        if found is None:  # even the Python operation failed: MPI itself is unusable
            raise RuntimeError(f"no way to sum {dtype} over MPI: " + "; ".join(failures))
        if failures and MPI.COMM_WORLD.Get_rank() == 0:
            print(f"pacmpi: {dtype} all-reduce sums use the {found.route} route "
                  f"({failures[0]})", file=sys.stderr, flush=True)
        _HALF_SUM_OPS[dtype] = found
        return found


def half_sum_route(dtype=None):
    """How this process sums float16/bfloat16 in all-reduces: ``"numba cfunc"`` (compiled
    user op), ``"native MPI_C_FLOAT16"`` (the MPI library's half type) or ``"python"``.

    With ``dtype=None``, both half dtypes (bfloat16 when ml_dtypes is installed); should they
    differ, ``"float16: ..., bfloat16: ..."``. Initializes MPI (through mpi4py) if needed.
    """
    from mpi4py import MPI

    dtypes = _half_dtypes() if dtype is None else (np.dtype(dtype),)
    for d in dtypes:
        if d not in _half_dtypes():
            raise ValueError(f"{d} is not a half-precision dtype")
    routes = {d.name: _half_sum(MPI, d).route for d in dtypes}
    if len(set(routes.values())) == 1:
        return next(iter(routes.values()))
    return ", ".join(f"{name}: {route}" for name, route in routes.items())


_MPICH_GPU_CUDA = 0  # MPIX_GPU_SUPPORT_CUDA in MPICH's mpi.h


def cuda_support(MPI):
    """``(answer, how)``: whether the MPI library mpi4py runs on takes CUDA device buffers
    (``None``: it cannot say), and the function that answered. mpi4py's
    ``MPI.Query_cuda_support`` where it has one, else the C function in the library itself:
    Open MPI's ``MPIX_Query_cuda_support()``, MPICH's ``MPIX_GPU_query_support``."""
    import ctypes

    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query()), "mpi4py MPI.Query_cuda_support()"
        except NotImplementedError:  # built without the MPIX extension
            pass
    try:
        return bool(_libmpi_function(MPI, "MPIX_Query_cuda_support")()), \
            "MPIX_Query_cuda_support()"
    except RuntimeError:
        pass
    try:
        gpu_query = _libmpi_function(MPI, "MPIX_GPU_query_support")
    except RuntimeError:
        return None, "the MPI library has no CUDA-support query"
    flag = ctypes.c_int(0)
    gpu_query(_MPICH_GPU_CUDA, ctypes.byref(flag))
    return bool(flag.value), "MPIX_GPU_query_support(CUDA)"


class MPICollectives(Collectives):
    """mpi4py transport.

    Parameters
    ----------
    comm:
        An ``mpi4py.MPI.Comm``; by default a duplicate of ``COMM_WORLD`` so pacmpi's messages
        never match the application's.
    cuda_aware:
        ``"auto"`` asks the MPI library (``MPIX_Query_cuda_support``); ``True`` hands CuPy
        buffers straight to MPI; ``False`` stages them through host memory.
    watchdog:
        A :class:`pacmpi.watchdog.StallWatchdog` told when each collective starts and ends,
        to report and abort stalls; ``None`` (default) costs one ``is None`` test per call.

    float16 and bfloat16 have no portable MPI reduction: they are summed by a compiled
    user-defined operation (Numba), the MPI library's own half type, or a Python operation,
    in that order of preference (:func:`half_sum_route`; CuPy buffers of those dtypes are
    host-staged). Every route matches NumPy's/ml_dtypes' addition bit for bit.
    """

    def __init__(self, *, comm=None, cuda_aware="auto", watchdog=None):
        from mpi4py import MPI

        if cuda_aware not in ("auto", True, False):
            raise ValueError(f"cuda_aware must be 'auto', True or False, got {cuda_aware!r}")
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup() if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cuda_aware = bool(cuda_support(MPI)[0]) if cuda_aware == "auto" else cuda_aware
        self._watchdog = watchdog

    def __getstate__(self):
        raise TypeError("MPICollectives holds a communicator and cannot be pickled")

    def _half_sum_op(self, dtype):
        """``(MPI datatype, MPI op)`` that sum ``dtype`` (see :func:`half_sum_route`)."""
        half = _half_sum(self._MPI, dtype)
        return half.datatype, half.op

    def _spec(self, buf, op):
        MPI = self._MPI
        dtype = np.dtype(buf.dtype)
        if dtype in _half_dtypes():
            if op != "sum":
                raise ValueError(f"only 'sum' is supported for {dtype}, got {op!r}")
            datatype, mpi_op = self._half_sum_op(dtype)
            return [buf, buf.size, datatype], mpi_op
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        return buf, (MPI.SUM if op == "sum" else MPI.MAX)

    def _needs_staging(self, buf):
        if not is_device_array(buf):
            return False
        return np.dtype(buf.dtype) in _half_dtypes() or not self.cuda_aware

    word_dtypes = ("int64", "int32", "uint64")

    def allreduce(self, buf, op="sum", name=None):
        if self._needs_staging(buf):
            synchronize(array_module(buf))
            host = buf.get()
            self.allreduce(host, op)
            buf.set(host)
            return
        synchronize(array_module(buf))
        spec, mpi_op = self._spec(buf, op)
        if self._watchdog is None:
            self.comm.Allreduce(self._MPI.IN_PLACE, spec, mpi_op)
        else:
            with self._watchdog.collective("Allreduce"):
                self.comm.Allreduce(self._MPI.IN_PLACE, spec, mpi_op)

    def iallreduce(self, buf, op="sum", name=None):
        watch = None if self._watchdog is None else self._watchdog.collective("Iallreduce")
        if self._needs_staging(buf):
            synchronize(array_module(buf))
            host = buf.get()
            spec, mpi_op = self._spec(host, op)
            request = self.comm.Iallreduce(self._MPI.IN_PLACE, spec, mpi_op)
            return _StagedRequest(request, watch, host, buf)
        synchronize(array_module(buf))
        spec, mpi_op = self._spec(buf, op)
        return _MPIRequest(self.comm.Iallreduce(self._MPI.IN_PLACE, spec, mpi_op), watch)

    def reduce(self, buf, op="sum", root=0, name=None):
        if self._needs_staging(buf):
            synchronize(array_module(buf))
            host = buf.get()
            self.reduce(host, op, root=root)
            if self.rank == root:
                buf.set(host)
            return
        synchronize(array_module(buf))
        spec, mpi_op = self._spec(buf, op)
        send, receive = (self._MPI.IN_PLACE, spec) if self.rank == root else (spec, None)
        if self._watchdog is None:
            self.comm.Reduce(send, receive, mpi_op, root=root)
        else:
            with self._watchdog.collective("Reduce"):
                self.comm.Reduce(send, receive, mpi_op, root=root)

    def bcast(self, buf, root=0, name=None):
        if is_device_array(buf) and not self.cuda_aware:
            synchronize(array_module(buf))
            host = buf.get()
            self.bcast(host, root=root)
            buf.set(host)
            return
        synchronize(array_module(buf))
        if self._watchdog is None:
            self.comm.Bcast(buf, root=root)
        else:
            with self._watchdog.collective("Bcast"):
                self.comm.Bcast(buf, root=root)

    def allgather_object(self, obj, name=None):
        if self._watchdog is None:
            return self.comm.allgather(obj)
        with self._watchdog.collective("allgather"):
            return self.comm.allgather(obj)


def default_collectives(comm=None, *, cuda_aware="auto"):
    """An :class:`MPICollectives` on ``comm`` (a duplicated ``COMM_WORLD`` by default)."""
    return MPICollectives(comm=comm, cuda_aware=cuda_aware)
