"""The ``pacmpi`` command: ``train``, ``bench allreduce``, ``bench train`` and ``info``.

Sub-commands that run under MPI go through :func:`pacmpi.faults.run_main`, so an exception on
one rank ends the whole job instead of leaving the others blocked in a collective.
"""
import importlib
import sys

from .faults import run_main

__all__ = ["main", "COMMANDS"]

COMMANDS = {
    ("train",): ("pacmpi.adapters.train", "distributed fine-tuning job (run under mpirun)"),
    ("bench", "allreduce"): ("pacmpi.bench.allreduce",
                             "dense vs packed vs ternary all-reduce (run under mpirun)"),
    ("bench", "train"): ("pacmpi.bench.train",
                         "end-to-end time-to-accuracy on shaped links (launches its own jobs)"),
    ("info",): ("pacmpi.cli", "versions, MPI library, CUDA-awareness, ternary wire bits"),
}


def _usage():
    lines = ["usage: pacmpi COMMAND [options]", "", "commands:"]
    for words, (_, text) in COMMANDS.items():
        lines.append(f"  {' '.join(words):<18} {text}")
    lines.append("")
    lines.append("`pacmpi COMMAND --help` shows a command's options.")
    return "\n".join(lines)


def info(argv=None):
    """Print what pacmpi runs on: versions, the MPI library and its CUDA support."""
    import numpy as np
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


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    for words, (module, _) in COMMANDS.items():
        if tuple(argv[:len(words)]) == words:
            rest = argv[len(words):]
            if words == ("info",):
                return run_main(info, rest)
            return run_main(importlib.import_module(module).main, rest)
    if argv and argv[0] not in ("-h", "--help"):
        print(f"pacmpi: unknown command {' '.join(argv[:2])!r}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    print(_usage())
    return 0


if __name__ == "__main__":
    sys.exit(main())
