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
- :mod:`.cli`: ``pacmpi-run``. Multi-node (Slurm, CUDA-aware MPI): see ``launch/README.md``
  and ``launch/slurm/pacmpi.sbatch``.
"""
from .failure import RankFailure, describe_failure, parse_rank_failure
from .launchers import (Launcher, LauncherNotFoundError, env_variable, find_launcher,
                        locate_launcher, python_env_bin)
from .mpi import (MPIDetectionError, MPIFlavor, build_horovodrun_command, build_mpirun_command,
                  build_torchrun_command, detect_mpi, parse_mpi_version, ring_allreduce_settings)
from .nodes import NODE_SUBNET, NodeTestbed, describe_daemon_failure, parse_daemon_failure
from .runner import (TIMEOUT_EXIT, RunResult, describe_calibration, parse_torchrun_failure,
                     run_command)
from .testbed import (CalibrationError, LinkTestbed, TestbedError, format_rate, link_model,
                      parse_rate, probe_testbed)

__all__ = [
    "find_launcher", "locate_launcher", "Launcher", "LauncherNotFoundError", "env_variable",
    "python_env_bin",
    "MPIFlavor", "MPIDetectionError", "parse_mpi_version", "detect_mpi", "build_mpirun_command",
    "build_horovodrun_command", "build_torchrun_command", "ring_allreduce_settings",
    "LinkTestbed", "TestbedError", "CalibrationError", "parse_rate", "format_rate", "link_model",
    "probe_testbed",
    "NodeTestbed", "NODE_SUBNET", "parse_daemon_failure", "describe_daemon_failure",
    "describe_calibration",
    "RunResult", "run_command", "TIMEOUT_EXIT", "parse_torchrun_failure",
    "RankFailure", "parse_rank_failure", "describe_failure",
]
