"""``pacmpi-run``: start a command on n ranks, optionally on a bandwidth-limited test bed.

Examples::

    pacmpi-run -n 4 -- python train.py --epochs 1
    pacmpi-run -n 4 --link 100mbit -- python train.py          # shaped link, calibrated first
    pacmpi-run -n 4 --horovod -- python train_hvd.py            # horovodrun --gloo
    pacmpi-run -n 4 --torchrun -- pacmpi train --backend ddp    # torchrun --standalone
    pacmpi-run -n 4 --link 1gbit --dry-run -- python train.py  # print, run nothing
    pacmpi-run -n 8 --nodes 4 --link 100mbit -- python train.py  # 4 nodes x 2 ranks, star
    pacmpi-run -n 8 --nodes 4 --link 100mbit --torchrun -- python t.py  # a torchrun per node

Exit status: the launcher's (non-zero when a rank fails; the failed rank is named on
stderr), 124 after ``--timeout``, 130 after Ctrl-C/SIGINT, 143 after SIGTERM (also when the
parent left them ignored), 2 for usage and set-up errors (no root, no ``ip``/``tc``, no MPI),
3 when calibration refuses the test bed.

``mpirun`` is found even when the venv is not activated: ``--mpirun``/``$PACMPI_MPIRUN``,
then the running Python's ``bin``, then ``PATH`` (``horovodrun``: ``$PACMPI_HOROVODRUN``,
``torchrun``: ``$PACMPI_TORCHRUN``, ...). With ``--torchrun --link`` the calibration still uses
``mpirun``; the job itself does not.
"""
import argparse
import shlex
import sys

from pacmpi.cli_options import (
    HelpFormatter,
    add_hostfile,
    add_link,
    add_mpirun,
    add_nodes,
    add_oversubscribe,
    add_timeout,
)

from ._signals import unwind_on_signals
from .mpi import ALLREDUCE_CHOICES, MPIDetectionError
from .runner import run_command
from .testbed import CalibrationError, TestbedError

__all__ = ["main", "build_parser", "run_command"]

USAGE_EXIT, CALIBRATION_EXIT, INTERRUPT_EXIT = 2, 3, 130


def build_parser():
    """The argument parser (options only; the command follows ``--``)."""
    parser = argparse.ArgumentParser(
        prog="pacmpi-run", usage="pacmpi-run -n N [options] -- COMMAND [ARGS...]",
        formatter_class=HelpFormatter,
        description="Run COMMAND on N ranks with mpirun (or horovodrun, torchrun), optionally on a "
                    "bandwidth-limited link simulated in a network namespace; COMMAND's output "
                    "passes through, and the exit status is the launcher's (--dry-run: print "
                    "the commands, run nothing).")
    parser.add_argument("-n", "--np", type=int, required=True, metavar="N",
                        help="number of ranks; required")
    add_link(parser)
    launcher = parser.add_mutually_exclusive_group()
    launcher.add_argument("--horovod", action="store_true", help="launch with horovodrun --gloo")
    launcher.add_argument("--torchrun", action="store_true",
                          help="launch with torchrun --standalone --nproc-per-node N "
                               "--no-python (gloo/NCCL via torch.distributed); with --nodes K "
                               "a torchrun --nnodes K per node")
    add_nodes(parser)
    parser.add_argument("--topology", choices=("star", "shared"),
                        help="with --nodes: 'star' (default) shapes every node's link both ways; "
                             "'shared' puts all traffic through one RATE queue")
    add_oversubscribe(parser)
    add_hostfile(parser)
    parser.add_argument("-x", "--env", action="append", default=[], metavar="NAME[=VALUE]",
                        help="forward (NAME) or set (NAME=VALUE) an environment variable on all "
                             "ranks; repeatable")
    parser.add_argument("--allreduce-algorithm", choices=ALLREDUCE_CHOICES, default="auto",
                        help="the job's MPI all-reduce: 'auto' (default) pins the ring the test "
                             "bed's calibration measures on every rank (with --link/--nodes, "
                             "unless -x or the environment already set the algorithm), 'ring' "
                             "pins it anywhere, 'default' leaves it to the MPI library")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--no-calibrate", action="store_true",
                        help="with --link, skip the link calibration")
    add_timeout(parser, None, "end the run after SECONDS, exit status 124 (default: no limit)")
    add_mpirun(parser)
    return parser


def _split(argv):
    """Split at the first ``--``; without one, everything after the options is the command."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1:]
    return argv, None


def main(argv=None):
    """Console entry point; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    options, command = _split(argv)
    if command is None:
        parser.add_argument("command", nargs=argparse.REMAINDER,
                            help="the command every rank runs, with its arguments (after --)")
        args = parser.parse_args(options)
        command = args.command
    else:
        args = parser.parse_args(options)
    if not command:
        parser.error("no command given (put it after --)")
    try:
        # Ctrl-C and SIGTERM stop a run even when they came ignored from the parent (a
        # background job of a non-interactive shell gets SIGINT ignored): a run otherwise lasts
        # until its --timeout, and whoever sent the signal kills it, leaving its ranks running.
        with unwind_on_signals(even_if_ignored=True):
            result = run_command(command, args.np, link=args.link, nodes=args.nodes,
                                 topology=args.topology, horovod=args.horovod,
                                 torchrun=args.torchrun,
                                 oversubscribe=args.oversubscribe, hostfile=args.hostfile,
                                 env=args.env, calibrate=not args.no_calibrate,
                                 timeout=args.timeout, dry_run=args.dry_run, mpirun=args.mpirun,
                                 allreduce=args.allreduce_algorithm)
    except CalibrationError as exc:
        print(f"pacmpi-run: {exc}", file=sys.stderr)
        return CALIBRATION_EXIT
    except (TestbedError, MPIDetectionError, ValueError, OSError) as exc:
        # OSError: the launcher itself could not be started (e.g. no horovodrun on PATH).
        print(f"pacmpi-run: error: {exc}", file=sys.stderr)
        return USAGE_EXIT
    except KeyboardInterrupt:
        print("pacmpi-run: interrupted; ranks ended and test bed removed", file=sys.stderr)
        return INTERRUPT_EXIT
    if args.dry_run:
        for step in result.setup_commands:
            print(f"# test bed: {shlex.join(step)}")
        for note in result.notes:
            print(f"# note: {note}")
        print(shlex.join(result.command))
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
