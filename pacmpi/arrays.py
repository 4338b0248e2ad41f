"""Array-module dispatch: NumPy arrays on CPU, CuPy arrays on GPU, chosen from the arrays.

CuPy is never imported here: an array can only be a CuPy array if the caller already imported
CuPy, so looking it up in ``sys.modules`` is enough and keeps ``import pacmpi`` light.
"""
import sys

import numpy as np

__all__ = [
    "array_module",
    "is_device_array",
    "synchronize",
    "to_host",
    "bfloat16_dtype",
    "supported_float_dtypes",
    "check_float_dtype",
]


def _cupy():
    return sys.modules.get("cupy")


def array_module(array):
    """Return the module (``numpy`` or ``cupy``) that owns ``array``."""
    cupy = _cupy()
    if cupy is not None and isinstance(array, cupy.ndarray):
        return cupy
    if isinstance(array, np.ndarray):
        return np
    raise TypeError(
        f"expected a numpy.ndarray or cupy.ndarray, got {type(array).__module__}."
        f"{type(array).__qualname__}"
    )


def is_device_array(array):
    """True when ``array`` lives in GPU memory (a CuPy array)."""
    cupy = _cupy()
    return cupy is not None and isinstance(array, cupy.ndarray)


def synchronize(xp):
    """Wait for the current CUDA stream, so MPI reads finished kernel output.

    This is the single place where pacmpi synchronizes before handing device memory to MPI.
    """
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def to_host(array):
    """Copy ``array`` to a NumPy array (no copy for NumPy input)."""
    if is_device_array(array):
        return array.get()
    return np.asarray(array)


def bfloat16_dtype():
    """NumPy's bfloat16 dtype from ``ml_dtypes`` when installed, else ``None``."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


_NATIVE_FLOATS = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def supported_float_dtypes():
    """The floating dtypes pacmpi can reduce on this installation."""
    dtypes = list(_NATIVE_FLOATS)
    bf16 = bfloat16_dtype()
    if bf16 is not None:
        dtypes.append(bf16)
    return tuple(dtypes)


def check_float_dtype(dtype, what="gradient"):
    """``dtype`` as a NumPy dtype (a name such as ``"bfloat16"`` too); ``TypeError`` naming it
    unless it is a supported floating dtype."""
    if isinstance(dtype, np.dtype) and (dtype in _NATIVE_FLOATS or dtype.name == "bfloat16"):
        return dtype  # without importing ml_dtypes (a second per process; a bfloat16 has it)
    supported = supported_float_dtypes()  # imports ml_dtypes, which registers "bfloat16"
    names = ", ".join(str(d) for d in supported)
    try:
        dtype = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{what} dtype {dtype!r} is not supported; use one of: {names}") from None
    if dtype not in supported:
        raise TypeError(f"{what} dtype {dtype} is not supported; use one of: {names}")
    return dtype
