"""Array modules to parametrize over: NumPy always, CuPy when a GPU is usable."""
import numpy as np
import pytest

__all__ = ["ARRAY_MODULES", "asnumpy"]


def _cupy_or_none():
    try:
        import cupy
        cupy.zeros(1).sum()
    except Exception:
        return None
    return cupy


_CUPY = _cupy_or_none()
ARRAY_MODULES = [pytest.param(np, id="numpy"),
                 pytest.param(_CUPY, id="cupy", marks=pytest.mark.skipif(
                     _CUPY is None, reason="CuPy with a usable GPU is not available"))]


def asnumpy(array):
    return array.get() if hasattr(array, "get") else np.asarray(array)
