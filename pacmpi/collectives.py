"""The small collective interface pacmpi needs, and its mpi4py implementation.

Adapters can plug in another transport (Horovod's) by implementing :class:`Collectives`; the
reducer then reuses packing, tracking, verification and quantization unchanged.
"""
import numpy as np

from .arrays import array_module, bfloat16_dtype, is_device_array, synchronize

__all__ = ["Collectives", "MPICollectives", "CompletedRequest", "default_collectives"]


_HALF_SUM_OPS = {}


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

    def allreduce(self, buf, op="sum"):
        """Reduce ``buf`` in place over all ranks; ``op`` is ``"sum"`` or ``"max"``."""
        raise NotImplementedError

    def iallreduce(self, buf, op="sum"):
        """Start an in-place reduction; return an object whose ``wait()`` completes it."""
        self.allreduce(buf, op)
        return CompletedRequest()

    def bcast(self, buf, root=0):
        """Broadcast ``buf`` in place from ``root``."""
        raise NotImplementedError

    def allgather_object(self, obj):
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


def _cuda_support(MPI):
    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except Exception:  # MPI without the MPIX extension raises NotImplementedError
        return False


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

    float16 and bfloat16 have no portable MPI reduction, so they travel as 16-bit words and are
    summed by a user-defined MPI operation (CuPy buffers of those dtypes are host-staged).
    """

    def __init__(self, *, comm=None, cuda_aware="auto", watchdog=None):
        from mpi4py import MPI

        if cuda_aware not in ("auto", True, False):
            raise ValueError(f"cuda_aware must be 'auto', True or False, got {cuda_aware!r}")
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD.Dup() if comm is None else comm
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cuda_aware = _cuda_support(MPI) if cuda_aware == "auto" else cuda_aware
        self._watchdog = watchdog

    def __getstate__(self):
        raise TypeError("MPICollectives holds a communicator and cannot be pickled")

    def _half_sum_op(self, dtype):
        # MPI allows only a few user-defined operations per process: one per dtype, shared.
        op = _HALF_SUM_OPS.get(dtype)
        if op is None:
            def _sum(inbuf, inoutbuf, datatype, _dtype=dtype):
                acc = np.frombuffer(inoutbuf, dtype=_dtype)
                acc += np.frombuffer(inbuf, dtype=_dtype)

            op = self._MPI.Op.Create(_sum, commute=True)
            _HALF_SUM_OPS[dtype] = op
        return op

    def _spec(self, buf, op):
        MPI = self._MPI
        dtype = np.dtype(buf.dtype)
        if dtype in _half_dtypes():
            if op != "sum":
                raise ValueError(f"only 'sum' is supported for {dtype}, got {op!r}")
            return [buf, buf.size, MPI.UINT16_T], self._half_sum_op(dtype)
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        return buf, (MPI.SUM if op == "sum" else MPI.MAX)

    def _needs_staging(self, buf):
        if not is_device_array(buf):
            return False
        return np.dtype(buf.dtype) in _half_dtypes() or not self.cuda_aware

    def allreduce(self, buf, op="sum"):
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

    def iallreduce(self, buf, op="sum"):
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

    def bcast(self, buf, root=0):
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

    def allgather_object(self, obj):
        if self._watchdog is None:
            return self.comm.allgather(obj)
        with self._watchdog.collective("allgather"):
            return self.comm.allgather(obj)


def default_collectives(comm=None, *, cuda_aware="auto"):
    """An :class:`MPICollectives` on ``comm`` (a duplicated ``COMM_WORLD`` by default)."""
    return MPICollectives(comm=comm, cuda_aware=cuda_aware)
