"""pacmpi.launch: start data-parallel jobs (``pacmpi-run``) and the bandwidth-limited test bed.

- :mod:`.launchers`: find ``mpirun``/``horovodrun``/``torchrun`` (explicit choice,
  ``$PACMPI_<NAME>``, the running Python's ``bin``, ``PATH``).
- :mod:`.mpi`: detect Open MPI 4/5, MPICH or Intel MPI and build ``mpirun``/``horovodrun``/
  ``torchrun`` command lines.
- :mod:`.testbed`: :class:`LinkTestbed`, one shared shaped link in a network namespace, with
  a calibration that refuses rates more than 15% off nominal.
- :mod:`.nodes`: :class:`NodeTestbed`, K simulated nodes (a namespace, an Open MPI daemon and
  a shaped link each, star or shared), calibrated against 2(K-1)/K*S/B.
- :mod:`.runner`: :func:`run_command`, the Python API behind the CLI.
- :mod:`.failure`: name the failed rank from the launcher's report.
- :mod:`.doctor`: ``pacmpi doctor``, what works here and what does not.
- :mod:`.tune`: ``pacmpi tune``, which MPI all-reduce algorithm is fastest at which size.
- :mod:`.cli`: ``pacmpi-run``. Multi-node (Slurm, CUDA-aware MPI): see ``docs/testbed.md``
  and ``launch/slurm/pacmpi.sbatch``.
"""
from .failure import RankFailure
from .launchers import Launcher, LauncherNotFoundError, find_launcher
from .mpi import (
                  MPIDetectionError,
                  MPIFlavor,
                  build_horovodrun_command,
                  build_mpirun_command,
                  build_torchrun_command,
                  detect_mpi,
)
from .nodes import NodeTestbed
from .runner import RunResult, run_command
from .testbed import CalibrationError, LinkTestbed, TestbedError

__all__ = [
    "run_command", "RunResult", "RankFailure",
    "LinkTestbed", "NodeTestbed", "TestbedError", "CalibrationError",
    "find_launcher", "Launcher", "LauncherNotFoundError",
    "detect_mpi", "MPIFlavor", "MPIDetectionError",
    "build_mpirun_command", "build_horovodrun_command", "build_torchrun_command",
]
