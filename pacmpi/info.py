"""``pacmpi info``: versions, the MPI library and its CUDA-awareness, the codec kernels and the
ternary wire bits per word type; prints what pacmpi runs on (``pacmpi doctor`` checks more, with
fixes)."""
import numpy as np

from .cli_options import command_parser

__all__ = ["main", "build_parser"]


def build_parser():
    return command_parser("pacmpi info", __doc__)


def main(argv=None):
    """Print what pacmpi runs on (``pacmpi doctor`` checks more, with fixes)."""
    build_parser().parse_args(argv)
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
