"""The C functions of the MPI library mpi4py runs on, through ctypes, for what mpi4py does not
wrap: ``MPI_Op_create`` over a compiled function's address (the half-precision sums) and the
MPIX CUDA-support queries (:func:`pacmpi.collectives.cuda_support`).
"""
import ctypes
import ctypes.util
import os

__all__ = ["function", "user_op"]


def function(MPI, name):
    """``name`` from the MPI library mpi4py runs on, through ctypes.

    Looked up through mpi4py's extension module first: ``dlsym`` on its handle searches the
    libraries it was linked against, so this is the very library mpi4py calls.
    """
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


def user_op(MPI, address):
    """An mpi4py ``Op`` for the commutative MPI_User_function at ``address`` (mpi4py's
    ``Op.Create`` takes only Python callables)."""
    op_create = function(MPI, "MPI_Op_create")
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
