"""Zero-copy conversion between torch tensors and the arrays the core works on: NumPy for CPU
tensors, CuPy (through DLPack) for CUDA tensors. CuPy is imported only when a CUDA tensor is
seen."""
import numpy as np
import torch

__all__ = ["as_array", "as_tensor", "numpy_dtype"]


def as_array(tensor):
    """Zero-copy NumPy (CPU) or CuPy (CUDA) view of ``tensor``, sharing its memory."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.numpy()
    if tensor.device.type == "cuda":
        import cupy  # only users with CUDA tensors need CuPy

        return cupy.from_dlpack(tensor)
    raise TypeError(f"tensors on {tensor.device} are not supported (use CPU or CUDA)")


def as_tensor(array):
    """Zero-copy torch tensor of a NumPy (CPU) or CuPy (CUDA, via DLPack) array."""
    if isinstance(array, np.ndarray):
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def numpy_dtype(torch_dtype):
    """The NumPy dtype of a torch dtype (float16/32/64; bfloat16 has none in NumPy)."""
    return torch.empty(0, dtype=torch_dtype).numpy().dtype
