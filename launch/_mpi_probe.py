"""The MPI library behind mpi4py, probed in a child process by ``pacmpi doctor``.

Usage: ``python _mpi_probe.py``; prints one JSON line. It initializes MPI as a singleton (no
launcher), which is what can crash or hang on a broken installation: the doctor runs this in
a child with a timeout so it can report that instead of dying with it.

CUDA-awareness is asked of the library itself, by :func:`pacmpi.collectives.cuda_support`;
the all-reduce algorithms it was told to run (the environment's settings, as every rank of a
job started from here would read them), by :func:`pacmpi.collectives.allreduce_algorithm`.
"""
import json
import os
import sys


def _loaded_libmpi():
    """Path of the MPI library this process loaded (Linux: from /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split()[-1]
                if os.path.basename(path).startswith(("libmpi.", "libmpich.")):
                    return path
    except OSError:
        pass
    return None


def main():
    import mpi4py
    from mpi4py import MPI  # initializes MPI: the singleton start is part of the probe

    libmpi = _loaded_libmpi()
    try:
        from pacmpi.collectives import MPICollectives, allreduce_algorithm, cuda_support

        cuda, how = cuda_support(MPI)
        pacmpi_auto = MPICollectives().cuda_aware
        algorithms = {"allreduce": allreduce_algorithm(MPI),
                      "iallreduce": allreduce_algorithm(MPI, nonblocking=True)}
    except Exception as exc:  # the report must come out even when pacmpi's import is broken
        cuda, how, pacmpi_auto = None, f"error: {exc}", f"error: {exc}"
        algorithms = {"error": str(exc)}
    vendor, version = MPI.get_vendor()
    print(json.dumps({
        "mpi4py": mpi4py.__version__,
        "library": MPI.Get_library_version().strip().splitlines()[0],
        "vendor": vendor, "version": ".".join(map(str, version)),
        "standard": "{}.{}".format(*MPI.Get_version()),
        "initialized": bool(MPI.Is_initialized()), "world_size": MPI.COMM_WORLD.Get_size(),
        "libmpi": libmpi, "cuda_aware": cuda, "cuda_query": how,
        "pacmpi_cuda_aware_auto": pacmpi_auto, "algorithms": algorithms,
    }), flush=True)


if __name__ == "__main__":
    sys.exit(main())
