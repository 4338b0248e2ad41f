"""``pacmpi info``: versions, the MPI library and its CUDA-awareness, ternary wire bits."""
import argparse

import numpy as np

__all__ = ["main"]


def main(argv=None):
    """Print what pacmpi runs on (``pacmpi doctor`` checks more, with fixes)."""
    argparse.ArgumentParser(prog="pacmpi info", description=(__doc__ or "").partition(": ")[2]
                            ).parse_args(argv)
    # Imported here: initializing MPI is this command's job, not the import's.
    from mpi4py import MPI

    from . import __version__
    from .collectives import MPICollectives
    from .half_sum import half_sum_route
    from .kernels import backend
    from .ternary import format_wire_bits

    print(f"pacmpi {__version__}; numpy {np.__version__}")
    print(MPI.Get_library_version().strip().splitlines()[0])
    print(f"CUDA-aware MPI: {MPICollectives().cuda_aware}")
    print(f"codec kernels: {backend(np)} (NumPy arrays); float16/bfloat16 sums: "
          f"{half_sum_route()}")
    print("ternary bits/value on the wire (digits per word), by word type:")
    print(format_wire_bits())
    return 0
