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
    from .ternary import wire_bits_table

    print(f"pacmpi {__version__}; numpy {np.__version__}")
    print(MPI.Get_library_version().strip().splitlines()[0])
    print(f"CUDA-aware MPI: {MPICollectives().cuda_aware}")
    for row in wire_bits_table():
        print(f"ternary on {row['ranks']:>2} ranks: {row['bits_per_value']:.3f} bits/value "
              f"(bound log2(2n+1) = {row['log2_2n_plus_1']:.3f})")
    return 0
