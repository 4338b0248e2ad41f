"""A NumPy-backed stand-in for the CuPy module, so pacmpi's device path runs on a CPU.

Device arrays are :class:`ndarray`, a ``numpy.ndarray`` subclass in host memory. Kept from
CuPy: the array type is not NumPy's; the module's functions (NumPy's, delegated) return device
arrays, and full reductions 0-d device arrays; an operation mixing a device array with a NumPy
array raises TypeError; host copies are ``get``/``asnumpy`` and ``set``, which checks as
CuPy's does; NumPy's functions called on device arrays dispatch here (``__array_function__``);
streams: the current one per thread, ``with stream:``, ``ExternalStream``; ``from_dlpack``;
``RawModule`` is ``host_cuda``'s (the CUDA source compiled for the host).

Not kept: asynchrony. Every operation has finished when it returns, so a missing
synchronization cannot show as wrong numbers; it shows in the event log instead: while
:func:`recording` is active, every device operation (``work``), host copy (``get``, ``set``)
and stream ``sync`` is appended to it with the current stream. Nor does ``numpy.asarray`` of
a device array raise, as CuPy's does: NumPy converts a subclass without asking it; and a
device array passes ``isinstance(x, numpy.ndarray)``, where CuPy's does not.
"""
import contextlib
import sys
import threading
import types
from dataclasses import dataclass

import numpy as np

import host_cuda

__all__ = ["ndarray", "asarray", "array", "asnumpy", "from_dlpack", "RawModule", "cuda",
           "Event", "recording", "install"]

_log = None  # the list events go to while recording(), else None
_local = threading.local()  # .streams: this thread's stack of current streams


@dataclass(frozen=True)
class Event:
    """One entry of the log: ``kind`` is ``work``, ``get``, ``set``, ``sync`` or, written by
    tests, something else (an MPI call); ``stream`` the stream's name; ``what`` a detail."""

    kind: str
    stream: str
    what: object = None


def record(kind, what=None, stream=None):
    """Append an event on ``stream`` (default: the current one) while recording."""
    if _log is not None:
        _log.append(Event(kind, (stream or cuda.get_current_stream()).name, what))


@contextlib.contextmanager
def recording():
    """Log events into the list yielded, until the block ends."""
    global _log
    previous, _log = _log, []
    try:
        yield _log
    finally:
        _log = previous


# ------------------------------------------------------------------------------ streams
class Stream:
    """A CUDA stream; ``with stream:`` makes it current for this thread, as CuPy's."""

    def __init__(self, name):
        self.name = name

    def synchronize(self):
        record("sync", stream=self)

    def __enter__(self):
        _streams().append(self)
        return self

    def __exit__(self, *exc):
        _streams().pop()


class ExternalStream(Stream):
    """A stream made elsewhere (torch's), known by its pointer."""

    def __init__(self, ptr, device_id=-1):
        super().__init__(f"external {ptr:#x}")
        self.ptr = ptr


_NULL = Stream("null")


def _streams():
    if not hasattr(_local, "streams"):
        _local.streams = []
    return _local.streams


def get_current_stream(device_id=None):
    stack = _streams()
    return stack[-1] if stack else _NULL


class Device:
    """``Device().id``: the current device, always 0 here."""

    def __init__(self, device=None):
        self.id = 0 if device is None else int(device)


cuda = types.ModuleType("cupy.cuda", "CuPy's cuda namespace: streams and devices.")
cuda.Stream, cuda.ExternalStream, cuda.Device = Stream, ExternalStream, Device
cuda.get_current_stream = get_current_stream


# ------------------------------------------------------------------------------ arrays
def _refuse_host(what, values):
    """CuPy's TypeError for a NumPy array among an operation's operands."""
    for value in values:
        if isinstance(value, (list, tuple)):
            _refuse_host(what, value)
        elif isinstance(value, np.ndarray) and not isinstance(value, ndarray):
            raise TypeError(f"{what}: unsupported type {type(value)} (a NumPy array among "
                            "device arrays; CuPy does not convert implicitly)")


def _plain(value):
    """Device arrays (also inside lists and tuples) as NumPy views of the same memory."""
    if isinstance(value, ndarray):
        return value.view(np.ndarray)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    return value


def _device(value):
    """NumPy results as device arrays; scalars as 0-d arrays, as CuPy returns them."""
    if isinstance(value, (np.ndarray, np.generic)):
        return np.asarray(value).view(ndarray)
    if isinstance(value, tuple):
        return tuple(_device(v) for v in value)
    return value


class ndarray(np.ndarray):  # noqa: N801  (CuPy's name)
    """An array in (stand-in) device memory."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=(), **kwargs):
        what = f"{ufunc.__name__}.{method}"
        _refuse_host(what, inputs + out)
        record("work", what)
        if out:
            kwargs["out"] = _plain(out)
        result = getattr(ufunc, method)(*_plain(inputs), **kwargs)
        if out:
            return out[0] if len(out) == 1 else out
        return _device(result)

    def __array_function__(self, func, types, args, kwargs):
        return getattr(sys.modules[__name__], func.__name__)(*args, **kwargs)

    def __getitem__(self, key):
        if isinstance(key, (np.ndarray, list)) or (
                isinstance(key, tuple) and any(isinstance(k, np.ndarray) for k in key)):
            record("work", "take")  # a gather; a basic slice is a view, no kernel
        return super().__getitem__(_plain(key))

    def __setitem__(self, key, value):
        record("work", "setitem")
        super().__setitem__(_plain(key), _plain(value))

    def astype(self, dtype, *args, **kwargs):
        record("work", "astype")
        return super().astype(dtype, *args, **kwargs)

    def copy(self, order="C"):
        record("work", "copy")
        return super().copy(order)

    def fill(self, value):
        record("work", "fill")
        super().fill(value)

    def get(self, stream=None, order="C", out=None, blocking=True):
        """A NumPy copy (device to host), on ``stream`` or the current one."""
        record("get", self.dtype.name, stream)
        return np.array(self.view(np.ndarray), order=order, copy=True)

    def set(self, arr, stream=None):
        """Copy the NumPy array ``arr`` in (host to device) on ``stream`` or the current one,
        with CuPy's checks."""
        if not isinstance(arr, np.ndarray) or isinstance(arr, ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not self.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        record("set", self.dtype.name, stream)
        self.view(np.ndarray)[...] = arr


def asarray(a, dtype=None, order=None):
    """``a`` on the device: the same array when it is one already (of ``dtype``), else a copy
    (host data is copied to the device)."""
    if isinstance(a, ndarray) and (dtype is None or np.dtype(dtype) == a.dtype):
        return a
    record("work", "asarray")
    return np.array(_plain(a), dtype=dtype, order=order or "K").view(ndarray)


def array(obj, dtype=None, copy=True, order="K", ndmin=0):
    record("work", "array")
    return np.array(_plain(obj), dtype=dtype, copy=copy, order=order, ndmin=ndmin).view(ndarray)


def asnumpy(a, stream=None, order="C", out=None, blocking=True):
    """A NumPy array of ``a`` (copied from the device; host data as it is)."""
    return a.get(order=order) if isinstance(a, ndarray) else np.asarray(a, order=order)


def from_dlpack(tensor):
    """A device array sharing ``tensor``'s memory (any DLPack producer on the host here)."""
    return np.from_dlpack(tensor).view(ndarray)


class RawModule(host_cuda.RawModule):
    """host_cuda's: the CUDA source compiled for the host; each launch is logged as ``work``."""

    def get_function(self, name_expression):
        return _Launches(super().get_function(name_expression))


class _Launches:
    """A kernel whose every launch is logged, then made."""

    def __init__(self, kernel):
        self._kernel = kernel

    def __getattr__(self, name):
        return getattr(self._kernel, name)

    def __call__(self, grid, block, args, shared_mem=0):
        record("work", self._kernel.name)
        return self._kernel(grid, block, args, shared_mem)


_functions = {}


def __getattr__(name):
    """NumPy's ``name``: types and constants as they are (CuPy re-exports NumPy's scalar
    types), functions on device arrays returning device arrays."""
    value = getattr(np, name)
    if not callable(value) or isinstance(value, type):
        return value
    if name not in _functions:
        def function(*args, **kwargs):
            _refuse_host(name, list(args) + list(kwargs.values()))
            record("work", name)
            result = value(*_plain(args), **{k: _plain(v) for k, v in kwargs.items()})
            out = kwargs.get("out")
            return out if isinstance(out, ndarray) else _device(result)

        function.__name__ = function.__qualname__ = name
        _functions[name] = function
    return _functions[name]


def install():
    """Make this module ``cupy`` for the process (``import cupy`` and pacmpi's look-ups);
    tests in a shared process use ``monkeypatch.setitem(sys.modules, "cupy", host_cupy)``."""
    sys.modules["cupy"] = sys.modules[__name__]
