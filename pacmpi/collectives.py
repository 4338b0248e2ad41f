"""The small collective interface pacmpi needs, and its mpi4py implementation.

Adapters can plug in another transport (Horovod's) by implementing :class:`Collectives`; the
reducer then reuses packing, tracking, verification and quantization unchanged.
"""
import contextlib
import ctypes

import numpy as np

from . import _libmpi
from .arrays import array_module, is_device_array, synchronize
from .half_sum import half_sum, is_half

__all__ = ["Collectives", "MPICollectives", "default_collectives", "allreduce_algorithm"]


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

    def progress(self, requests):
        """Let ``requests`` (from :meth:`iallreduce`) move on without waiting for them; for a
        caller with other work to do meanwhile, now and then. Nothing here: a transport whose
        collectives run on threads of their own (Horovod, torch.distributed) needs nothing."""

    def bcast(self, buf, root=0, name=None):
        """Broadcast ``buf`` in place from ``root``."""
        raise NotImplementedError

    def reduce(self, buf, op="sum", root=0, name=None):
        """Reduce ``buf`` into ``root``'s ``buf`` in place; the other ranks' ``buf`` is only
        read."""
        raise NotImplementedError

    def reduce_scatter(self, buf, out, counts, op="sum", name=None):
        """Reduce ``buf`` over ranks and write block ``rank`` of the result into ``out``.

        ``buf`` (only read) is split into ``len(counts) == size`` consecutive blocks of
        ``counts`` elements (uneven and zero counts allowed); ``out`` has ``counts[rank]``.
        This fallback all-reduces a copy of the whole buffer, so a transport without a
        reduce-scatter still works, at all-reduce cost; MPI's is a true reduce-scatter."""
        start, stop = check_blocks(self, counts, buf, out)
        whole = buf.copy()
        self.allreduce(whole, op, name=name)
        out[...] = whole[start:stop]

    def allgather(self, buf, counts, name=None):
        """In place: block ``rank`` of ``buf`` (split as in :meth:`reduce_scatter`) is this
        rank's; afterwards every block holds its owner's values. Only moves bits (no
        arithmetic, so -0.0 and NaN payloads survive). This fallback broadcasts each block
        from its owner; MPI's is one all-gather."""
        check_blocks(self, counts, buf)
        for root, (start, stop) in enumerate(block_bounds(counts)):
            if stop > start:
                self.bcast(buf[start:stop], root=root,
                           name=None if name is None else f"{name}.{root}")

    def allgather_object(self, obj, name=None):
        """Gather one picklable object from every rank, in rank order, on every rank."""
        raise NotImplementedError


def block_bounds(counts):
    """``[(start, stop)]`` of consecutive blocks of ``counts`` elements."""
    stops = np.cumsum(counts, dtype=np.int64)
    return [(int(stop - count), int(stop)) for count, stop in zip(counts, stops)]


def check_blocks(collectives, counts, buf, out=None):
    """``(start, stop)`` of ``collectives.rank``'s block, for the transports' reduce_scatter and
    allgather; ValueError naming the sizes when ``counts`` is not one count per rank that
    splits ``buf`` (and gives ``out`` its size)."""
    counts = [int(c) for c in counts]
    rank = collectives.rank
    if len(counts) != collectives.size:
        raise ValueError(f"{len(counts)} counts for {collectives.size} ranks")
    if min(counts, default=0) < 0 or sum(counts) != buf.size:
        raise ValueError(f"counts {counts} do not split a buffer of {buf.size} elements")
    if out is not None and out.size != counts[rank]:
        raise ValueError(f"rank {rank}'s block has {counts[rank]} elements, out has {out.size}")
    return block_bounds(counts)[rank]


_UNWATCHED = contextlib.nullcontext()


class _MPIRequest:
    """An MPI request; ``watch`` is the stall watchdog's context for its wait."""

    def __init__(self, request, watch=_UNWATCHED):
        self._request, self._watch = request, watch

    def wait(self):
        with self._watch:
            self._request.Wait()

    def test(self):
        """``MPI_Test``: move the request on, without waiting; whether it is complete."""
        return self._request.Test()


class _StagedRequest(_MPIRequest):
    """Completes a host-staged reduction by copying the result back to the device."""

    def __init__(self, request, watch, host, device):
        super().__init__(request, watch)
        self._host, self._device = host, device

    def wait(self):
        super().wait()
        self._device.set(self._host)


_MPICH_GPU_CUDA = 0  # MPIX_GPU_SUPPORT_CUDA in MPICH's mpi.h


def cuda_support(MPI):
    """``(answer, how)``: whether the MPI library mpi4py runs on takes CUDA device buffers
    (``None``: it cannot say), and the function that answered. mpi4py's
    ``MPI.Query_cuda_support`` where it has one, else the C function in the library itself:
    Open MPI's ``MPIX_Query_cuda_support()``, MPICH's ``MPIX_GPU_query_support``."""
    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query()), "mpi4py MPI.Query_cuda_support()"
        except NotImplementedError:  # built without the MPIX extension
            pass
    try:
        return bool(_libmpi.function(MPI, "MPIX_Query_cuda_support")()), \
            "MPIX_Query_cuda_support()"
    except RuntimeError:
        pass
    try:
        gpu_query = _libmpi.function(MPI, "MPIX_GPU_query_support")
    except RuntimeError:
        return None, "the MPI library has no CUDA-support query"
    flag = ctypes.c_int(0)
    gpu_query(_MPICH_GPU_CUDA, ctypes.byref(flag))
    return bool(flag.value), "MPIX_GPU_query_support(CUDA)"


def allreduce_algorithm(MPI, *, nonblocking=False):
    """The all-reduce algorithm the MPI library mpi4py runs on was told to use, read back from
    the library (MPI_T control variables, after ``MPI_Init``): ``"default"`` (its own choice
    per call), the forced algorithm's name (``"ring"``, ``"recursive_doubling"``, ...), for
    Open MPI's blocking all-reduce also ``"rules file PATH"`` (a
    ``coll_tuned_dynamic_rules_filename``, which Open MPI consults first); ``None`` for a
    library that cannot say. What ``pacmpi-run`` pins on the test bed and ``pacmpi tune``
    recommends, checked where it acts.

    ``nonblocking``: the algorithm of ``MPI_Iallreduce``, which :class:`PacTrainReducer`
    runs, instead of ``MPI_Allreduce``'s (Horovod's, the benchmark's). The libraries choose
    them apart: Open MPI in coll/libnbc (``coll_libnbc_iallreduce_algorithm``; its own choice
    for an in-place buffer is a binomial tree) and coll/tuned (``coll_tuned_use_dynamic_rules``
    and ``coll_tuned_allreduce_algorithm``), MPICH in ``MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM``
    and ``MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM``.
    """
    library = MPI.Get_library_version()
    if library.startswith("MPICH"):
        kind = "IALLREDUCE" if nonblocking else "ALLREDUCE"
        forced = _libmpi.control_variable(MPI, f"MPIR_CVAR_{kind}_INTRA_ALGORITHM")
        return None if forced is None else _named(forced)
    if not library.startswith("Open MPI"):
        return None
    if nonblocking:
        forced = _libmpi.control_variable(MPI, "coll_libnbc_iallreduce_algorithm")
        return None if forced is None else _named(forced)  # None: coll/libnbc not built
    dynamic = _libmpi.control_variable(MPI, "coll_tuned_use_dynamic_rules")
    forced = _libmpi.control_variable(MPI, "coll_tuned_allreduce_algorithm")
    rules = _libmpi.control_variable(MPI, "coll_tuned_dynamic_rules_filename")
    if dynamic is None or forced is None:  # coll/tuned not built
        return None
    if not dynamic[0]:
        return "default"
    if rules and rules[0]:
        return f"rules file {rules[0]}"
    return _named(forced)


def _named(setting):
    """An algorithm selector's ``(value, name)`` as the algorithm's name: value 0 (Open MPI's
    "ignore", MPICH's "auto") is the library's own choice, ``"default"``."""
    value, name = setting
    return "default" if value == 0 else name or str(value)


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
    in that order of preference (:func:`pacmpi.half_sum.half_sum_route`; CuPy buffers of those
    dtypes are host-staged). Every route matches NumPy's/ml_dtypes' addition bit for bit,
    NaN payloads aside.
    """

    def __init__(self, *, comm=None, cuda_aware="auto", watchdog=None):
        from mpi4py import MPI

        if cuda_aware not in ("auto", True, False):
            raise ValueError(f"cuda_aware must be 'auto', True or False, got {cuda_aware!r}")
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup() if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        supported, query = cuda_support(MPI)
        if cuda_aware is True and supported is False:
            # It would read device pointers as host memory: a segmentation fault, or worse.
            raise ValueError(f"cuda_aware=True, but the MPI library has no CUDA support ({query} "
                             f"says so); use cuda_aware='auto' or False (host staging)")
        self.cuda_aware = bool(supported) if cuda_aware == "auto" else cuda_aware
        self._watchdog = watchdog

    def __getstate__(self):
        raise TypeError("MPICollectives holds a communicator and cannot be pickled")

    def _spec(self, buf, op):
        MPI = self._MPI
        dtype = np.dtype(buf.dtype)
        if is_half(dtype):
            if op != "sum":
                raise ValueError(f"only 'sum' is supported for {dtype}, got {op!r}")
            half = half_sum(MPI, dtype)
            return [buf, buf.size, half.datatype], half.op
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        return buf, (MPI.SUM if op == "sum" else MPI.MAX)

    def _needs_staging(self, buf, reduces):
        """Whether MPI gets ``buf`` through host memory: a device buffer when MPI is not
        CUDA-aware, or one of a half type to be summed (no device sum); moving bits only,
        halves need no staging."""
        if not is_device_array(buf):
            return False
        return not self.cuda_aware or (reduces and is_half(buf.dtype))

    @contextlib.contextmanager
    def _staged(self, buf, *, reduces=True, copy_back=True):
        """The array MPI should get for ``buf``, after the one stream synchronization before
        MPI reads device memory: ``buf`` itself, or a host copy (:meth:`_needs_staging`) whose
        values ``buf`` takes when the block ends (``copy_back``; not when it raises)."""
        synchronize(array_module(buf))
        if not self._needs_staging(buf, reduces):
            yield buf
            return
        host = buf.get()
        yield host
        if copy_back:
            buf.set(host)

    def _watched(self, name):
        """The stall watchdog's context for collective ``name``, which it counts as entered
        now: a blocking call runs in it, a nonblocking one's wait."""
        return _UNWATCHED if self._watchdog is None else self._watchdog.collective(name)

    word_dtypes = ("int64", "int32", "uint64")

    def allreduce(self, buf, op="sum", name=None):
        with self._staged(buf) as target:
            spec, mpi_op = self._spec(target, op)
            with self._watched("Allreduce"):
                self.comm.Allreduce(self._MPI.IN_PLACE, spec, mpi_op)

    def iallreduce(self, buf, op="sum", name=None):
        watch = self._watched("Iallreduce")
        # The copy back waits for the request: _StagedRequest makes it.
        with self._staged(buf, copy_back=False) as target:
            spec, mpi_op = self._spec(target, op)
            request = self.comm.Iallreduce(self._MPI.IN_PLACE, spec, mpi_op)
        if target is buf:
            return _MPIRequest(request, watch)
        return _StagedRequest(request, watch, target, buf)

    def progress(self, requests):
        """``MPI_Test`` on each request. Open MPI advances a non-blocking collective only
        inside MPI calls (coll/libnbc has no thread of its own): posted while backward computes
        and left alone, an all-reduce waits for the next MPI call. Measured on 4 ranks over a
        shared 100 Mbit/s link, an 8 MB ``Iallreduce`` then 2 s of computation: done 5.9 s
        after posting when left alone, 3.9 s when tested every few milliseconds."""
        for request in requests:
            request.test()

    def reduce(self, buf, op="sum", root=0, name=None):
        with self._staged(buf, copy_back=self.rank == root) as target:
            spec, mpi_op = self._spec(target, op)
            send, receive = (self._MPI.IN_PLACE, spec) if self.rank == root else (spec, None)
            with self._watched("Reduce"):
                self.comm.Reduce(send, receive, mpi_op, root=root)

    def bcast(self, buf, root=0, name=None):
        with self._staged(buf, reduces=False) as target:
            # As 16-bit words: mpi4py takes no bfloat16 array itself (NumPy exports no buffer
            # of ml_dtypes' dtype, DLPack has none), and a broadcast only moves the bits.
            if is_half(target.dtype):
                target = [target, target.size, self._MPI.UINT16_T]
            with self._watched("Bcast"):
                self.comm.Bcast(target, root=root)

    def reduce_scatter(self, buf, out, counts, op="sum", name=None):
        check_blocks(self, counts, buf, out)
        with self._staged(buf, copy_back=False) as target:
            # out is staged with buf (its stream synchronized already); MPI only writes it.
            received = out if target is buf else np.empty(out.shape, dtype=out.dtype)
            spec, mpi_op = self._spec(target, op)
            received_spec, _ = self._spec(received, op)
            with self._watched("Reduce_scatter"):
                self.comm.Reduce_scatter(spec, received_spec, [int(c) for c in counts], mpi_op)
        if received is not out:
            out.set(received)

    def allgather(self, buf, counts, name=None):
        check_blocks(self, counts, buf)
        with self._staged(buf, reduces=False) as target:
            counts = [int(c) for c in counts]
            displacements = [start for start, _ in block_bounds(counts)]
            spec = [target, (counts, displacements)]
            if is_half(target.dtype):  # bits only, as in bcast: 16-bit words
                spec.append(self._MPI.UINT16_T)
            with self._watched("Allgatherv"):
                self.comm.Allgatherv(self._MPI.IN_PLACE, spec)

    def allgather_object(self, obj, name=None):
        with self._watched("allgather"):
            return self.comm.allgather(obj)


def default_collectives(comm=None, *, cuda_aware="auto"):
    """An :class:`MPICollectives` on ``comm`` (a duplicated ``COMM_WORLD`` by default)."""
    return MPICollectives(comm=comm, cuda_aware=cuda_aware)
