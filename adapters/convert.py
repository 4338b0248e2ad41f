"""Zero-copy conversion between torch tensors and the arrays the core works on: NumPy for CPU
tensors, CuPy (through DLPack) for CUDA tensors. CuPy is imported only when a CUDA tensor is
seen.

bfloat16 has no NumPy type and, before CuPy 14, no CuPy type or DLPack import; it crosses as
its 16-bit storage: a torch int16 view on one side, viewed as ``ml_dtypes.bfloat16`` on the
other (the same bytes, never a copy), on CPU and CUDA alike.
"""
import numpy as np
import torch

from pacmpi.arrays import bfloat16_dtype

__all__ = ["as_array", "as_tensor", "numpy_dtype"]

_BFLOAT16_CUPY = 14  # first CuPy major version whose arrays take ml_dtypes.bfloat16


def _bfloat16():
    """NumPy's bfloat16 dtype (ml_dtypes); a TypeError that says so when it is missing."""
    dtype = bfloat16_dtype()
    if dtype is None:
        raise TypeError("bfloat16 tensors need the ml_dtypes package (pip install ml_dtypes)")
    return dtype


def as_array(tensor):
    """Zero-copy NumPy (CPU) or CuPy (CUDA) view of ``tensor``, sharing its memory."""
    tensor = tensor.detach()
    if tensor.device.type not in ("cpu", "cuda"):
        raise TypeError(f"tensors on {tensor.device} are not supported (use CPU or CUDA)")
    bf16 = tensor.dtype == torch.bfloat16
    storage = tensor.view(torch.int16) if bf16 else tensor
    if tensor.device.type == "cpu":
        array = storage.numpy()
    else:
        import cupy  # only users with CUDA tensors need CuPy

        if bf16 and int(cupy.__version__.split(".")[0]) < _BFLOAT16_CUPY:
            raise TypeError(f"bfloat16 CUDA tensors need CuPy >= {_BFLOAT16_CUPY} with "
                            f"ml_dtypes; this is CuPy {cupy.__version__}")
        array = cupy.from_dlpack(storage)
    return array.view(_bfloat16()) if bf16 else array


def as_tensor(array):
    """Zero-copy torch tensor of a NumPy (CPU) or CuPy (CUDA, via DLPack) array."""
    bf16 = array.dtype.name == "bfloat16"  # not == bfloat16_dtype(): np.dtype(None) is float64
    storage = array.view(np.int16) if bf16 else array
    tensor = torch.from_numpy(storage) if isinstance(array, np.ndarray) else \
        torch.from_dlpack(storage)
    return tensor.view(torch.bfloat16) if bf16 else tensor


def numpy_dtype(torch_dtype):
    """The NumPy dtype of a floating torch dtype (bfloat16: ``ml_dtypes.bfloat16``)."""
    if torch_dtype == torch.bfloat16:
        return _bfloat16()
    return torch.empty(0, dtype=torch_dtype).numpy().dtype
