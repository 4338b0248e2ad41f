"""Find which rank failed in a launcher's output, so ``pacmpi-run`` can name it in one line.

Recognised reports (whitespace, including the launchers' own line wrapping, is normalised):

- Open MPI 4/5, rank killed by a signal: ``... noticed that process rank 2 with PID 4094 on
  node vm exited on signal 9 (Killed).``
- Open MPI 4/5 and horovodrun, rank exited non-zero: ``Process name: [prterun-vm-4102@1,1]``
  (Open MPI 5), ``[[12345,1],1]`` (Open MPI 4) or ``1`` (horovodrun) followed by
  ``Exit code: 3``.
- horovodrun's per-process line: ``Process 1 exit with status code 137.``
- MPICH/Intel Hydra: ``EXIT CODE: 9`` (Hydra names no rank; the rank stays ``None``).
"""
import re
import signal
from dataclasses import dataclass

__all__ = ["RankFailure", "parse_rank_failure", "describe_failure"]


@dataclass(frozen=True)
class RankFailure:
    """One failed rank: ``rank`` (``None`` when the launcher did not say), and either the
    ``signal`` that killed it or its ``exit_code``; ``pid`` and ``node`` when reported."""

    rank: int = None
    exit_code: int = None
    signal: int = None
    pid: int = None
    node: str = None


_SIGNALLED = re.compile(
    r"process rank (\d+) with PID (\d+) on node (\S+) exited on signal (\d+)")
_PROCESS_NAME = re.compile(r"Process name:\s*(\S+)\s+Exit code:\s*(-?\d+)")
_HOROVOD_PROCESS = re.compile(r"Process (\d+) exit with status code (-?\d+)")
_HYDRA = re.compile(r"EXIT CODE:\s*(-?\d+)")


def _rank_from_name(name):
    # "[prterun-vm-4102@1,1]" and "[[12345,1],1]" end in ",RANK]"; horovodrun names are "RANK".
    match = re.search(r",(\d+)\]+$", name) or re.fullmatch(r"\[?(\d+)\]?", name)
    return int(match.group(1)) if match else None


def parse_rank_failure(text):
    """Return the first :class:`RankFailure` reported in ``text``, or ``None``.

    A signal report wins over an exit-code report because it says more (what killed it).
    """
    flat = " ".join(text.split())
    match = _SIGNALLED.search(flat)
    if match:
        rank, pid, node, signum = match.groups()
        return RankFailure(rank=int(rank), signal=int(signum), pid=int(pid), node=node.rstrip(","))
    match = _PROCESS_NAME.search(flat)
    if match:
        return RankFailure(rank=_rank_from_name(match.group(1)), exit_code=int(match.group(2)))
    match = _HOROVOD_PROCESS.search(flat)
    if match:
        return RankFailure(rank=int(match.group(1)), exit_code=int(match.group(2)))
    match = _HYDRA.search(flat)
    if match:
        return RankFailure(exit_code=int(match.group(1)))
    return None


def _signal_name(signum):
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_failure(failure, returncode, launcher="mpirun"):
    """One line for the user: which rank failed, how, and the launcher's exit status."""
    if failure is None:
        return (f"pacmpi-run: {launcher} exited with status {returncode} "
                "(its output names no failed rank)")
    who = (f"rank {failure.rank}" if failure.rank is not None else
           "a rank (not named by the launcher)")
    where = ", ".join(part for part in (
        f"pid {failure.pid}" if failure.pid is not None else "",
        f"node {failure.node}" if failure.node else "") if part)
    if where:
        who += f" ({where})"
    if failure.signal is not None:
        how = f"was killed by signal {failure.signal} ({_signal_name(failure.signal)})"
    elif failure.exit_code is not None and failure.exit_code > 128:
        # Shells and horovodrun report death by signal S as exit code 128+S.
        how = (f"exited with code {failure.exit_code} "
               f"(= 128 + {_signal_name(failure.exit_code - 128)})")
    else:
        how = f"exited with code {failure.exit_code}"
    return f"pacmpi-run: {who} {how}; {launcher} exited with status {returncode}"
