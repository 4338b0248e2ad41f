"""Stall watchdog: name the ranks a collective is waiting for, then abort the job.

A rank blocked in a collective cannot ask the collective who is missing, and a stalled rank
(stuck in I/O, a deadlock, a dead GPU) answers no messages. So every rank keeps a tiny
heartbeat file, memory-mapped, with the sequence number of the latest collective it entered
and whether it is waiting in one. Writing it costs two stores into a mapped page per
collective; nobody reads it until a wait has lasted ``warn_after`` seconds. Then a daemon
thread on the waiting rank reads its peers' files and prints, on stderr, which ranks have not
entered that collective, by rank, host and pid, with what they last entered and how long
ago. After ``abort_after`` seconds it aborts the job (``MPI_Abort`` on ``COMM_WORLD``).

Use it through the transport (off unless given)::

    dog = StallWatchdog(warn_after=120, abort_after=900)
    reducer = PacTrainReducer(masks, collectives=MPICollectives(watchdog=dog))

Heartbeat files live in ``<base>/pacmpi-heartbeat-<job id>/rank-<r>``, where ``<base>`` is
``heartbeat_dir``, else ``$PACMPI_HEARTBEAT_DIR``, else the system temporary directory (enough
when all ranks share a node). Across nodes ``<base>`` must be on a filesystem every node sees
(Lustre, GPFS, BeeGFS, NFS). Each rank ``msync``s its file at most once per poll interval, so
NFS, which is coherent only on open, shows it within about a poll interval plus its own
attribute caching; keep ``warn_after`` well above that. A rank whose file cannot be read is
listed as "no heartbeat" rather than guessed about.

Limits: one watchdog per communicator, the watchdog's ``comm`` being the transport's
communicator or one with the same ranks (``COMM_WORLD`` and its duplicates); the job id comes
from the launcher (``PMIX_NAMESPACE`` under Open MPI / PMIx, ``SLURM_JOB_ID`` under Slurm,
or ``$PACMPI_JOB_ID``), and only without one is construction collective (rank 0 broadcasts a
token).
"""
import atexit
import mmap
import os
import re
import socket
import struct
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

from .faults import abort_job

__all__ = ["StallWatchdog"]

_MAGIC = b"PACMPIH1"
# Native byte order (standard sizes, no padding): the int64 view below writes in it.
# magic, rank, pid, host, job token
_HEADER = struct.Struct("=8sqq64s64s")
# sequence number of the latest collective entered, wall time of entering it, its name
_ARRIVAL = struct.Struct("=qd16s")
# sequence number of the collective being waited for, -1 when not waiting; written through
# an int64 view of the map, a third of the cost of struct.pack_into
_WAITING = struct.Struct("=q")
_ARRIVAL_AT = _HEADER.size
_WAITING_AT = _ARRIVAL_AT + _ARRIVAL.size
_WAITING_SLOT = _WAITING_AT // _WAITING.size
_FILE_SIZE = _WAITING_AT + _WAITING.size
_NOT_WAITING = -1


@dataclass(frozen=True)
class Heartbeat:
    """What a rank's heartbeat file says: its ``host`` and ``pid``, the sequence number,
    ``name`` and wall ``time`` of the latest collective it entered (``seq`` 0: none yet), and
    the sequence number it is ``waiting`` for (``-1``: not waiting)."""

    rank: int
    host: str
    pid: int
    seq: int
    time: float
    name: str
    waiting: int


def _job_id(comm):
    for name in ("PACMPI_JOB_ID", "PMIX_NAMESPACE", "SLURM_JOB_ID"):
        value = os.environ.get(name)
        if value:
            if name == "SLURM_JOB_ID":
                value += "." + os.environ.get("SLURM_STEP_ID", "0")
            return value
    token = f"pid{os.getpid()}-{time.time_ns()}"
    return comm.bcast(token, root=0) if comm.Get_size() > 1 else token


def heartbeat_directory(job_id, heartbeat_dir=None):
    """The directory of one job's heartbeat files (see the module docstring)."""
    base = heartbeat_dir or os.environ.get("PACMPI_HEARTBEAT_DIR") or tempfile.gettempdir()
    return os.path.join(base, "pacmpi-heartbeat-" + re.sub(r"[^A-Za-z0-9_.-]", "_", job_id))


def _text(raw):
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")


def _field(text, size):
    return text.encode("utf-8")[:size]


class _Wait:
    """Context around the wait for collective ``seq``: the watchdog times it."""

    __slots__ = ("_dog", "_seq", "_name")

    def __init__(self, dog, seq, name):
        self._dog, self._seq, self._name = dog, seq, name

    def __enter__(self):
        dog = self._dog
        dog._slots[_WAITING_SLOT] = self._seq
        dog._waiting = (self._seq, self._name, time.monotonic())
        return self

    def __exit__(self, *exc):
        dog = self._dog
        dog._waiting = None
        dog._slots[_WAITING_SLOT] = _NOT_WAITING
        if dog._warned is not None:
            dog._resolve()
        return False


class StallWatchdog:
    """Warns about, then aborts, collectives that wait too long (see the module docstring).

    Parameters
    ----------
    warn_after:
        Seconds a collective may wait before the ranks that have not entered it are printed
        (once per collective, by the lowest-numbered waiting rank).
    abort_after:
        Seconds after which the job is aborted with status ``abort_code``; ``None``: never.
    comm:
        Communicator whose ranks are watched (``COMM_WORLD`` by default; mpi4py is imported
        here, not before).
    heartbeat_dir:
        Base directory of the heartbeat files; must be shared by all nodes of the job.
    poll_interval:
        Seconds between checks of the thread; default ``warn_after / 10`` within [0.05, 1].
    abort_code:
        The job's exit status after a stall abort (``MPI_Abort``'s error code).
    stream:
        Where reports go (default ``sys.stderr`` at report time).
    """

    def __init__(self, warn_after=300.0, abort_after=None, *, comm=None, heartbeat_dir=None,
                 poll_interval=None, abort_code=1, stream=None):
        if not warn_after or warn_after <= 0:
            raise ValueError(f"warn_after must be a positive number of seconds, got {warn_after!r}")
        if abort_after is not None and abort_after < warn_after:
            raise ValueError(f"abort_after ({abort_after}) must be at least "
                             f"warn_after ({warn_after})")
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.warn_after, self.abort_after, self.abort_code = warn_after, abort_after, abort_code
        self.poll_interval = (min(1.0, max(0.05, warn_after / 10)) if poll_interval is None
                              else poll_interval)
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.host = socket.gethostname()
        self._stream = stream
        self._token = _job_id(comm)
        self._token_field = _field(self._token, 64)
        self.directory = heartbeat_directory(self._token, heartbeat_dir)
        os.makedirs(self.directory, exist_ok=True)
        self._path = self._file(self.rank)
        fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, _FILE_SIZE)
            self._map = mmap.mmap(fd, _FILE_SIZE)
        finally:
            os.close(fd)
        _HEADER.pack_into(self._map, 0, _MAGIC, self.rank, os.getpid(),
                          _field(self.host, 64), self._token_field)
        _ARRIVAL.pack_into(self._map, _ARRIVAL_AT, 0, time.time(), b"")
        self._slots = memoryview(self._map).cast("q")
        self._slots[_WAITING_SLOT] = _NOT_WAITING
        self._labels = {}
        self._seq = 0
        self._waiting = None
        self._warned = None  # the (seq, name, start) last warned about, until it completes
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pacmpi-stall-watchdog",
                                        daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _file(self, rank):
        return os.path.join(self.directory, f"rank-{rank}")

    # ------------------------------------------------------------------ hot path
    def collective(self, name):
        """Record entering the next collective; return the context to wrap its wait in.

        Blocking call: ``with dog.collective("Allreduce"): comm.Allreduce(...)``. Nonblocking:
        call at launch, keep the context, and wrap the request's ``Wait()`` in it later.
        """
        label = self._labels.get(name)
        if label is None:
            label = self._labels[name] = _field(name, 16)
        self._seq += 1
        _ARRIVAL.pack_into(self._map, _ARRIVAL_AT, self._seq, time.time(), label)
        return _Wait(self, self._seq, name)

    # ------------------------------------------------------------------ reading peers
    def heartbeats(self):
        """``{rank: Heartbeat or None}`` for every rank (``None``: no readable file of this job)."""
        return {rank: self._read(rank) for rank in range(self.size)}

    def _read(self, rank):
        try:
            # A fresh open each time: shared filesystems revalidate their caches on open.
            with open(self._file(rank), "rb") as f:
                raw = f.read(_FILE_SIZE)
        except OSError:
            return None
        if len(raw) < _FILE_SIZE:
            return None
        magic, file_rank, pid, host, token = _HEADER.unpack_from(raw, 0)
        if magic != _MAGIC or file_rank != rank or token.rstrip(b"\0") != self._token_field:
            return None  # not (yet) written by this job's rank
        seq, when, name = _ARRIVAL.unpack_from(raw, _ARRIVAL_AT)
        (waiting,) = _WAITING.unpack_from(raw, _WAITING_AT)
        return Heartbeat(rank, _text(host), pid, seq, when, _text(name), waiting)

    def describe(self, seq, name, waited):
        """``(should_print, line)``: who collective ``seq`` waits for, after ``waited`` s.

        Only the lowest-numbered rank seen waiting for ``seq`` should print, unless some
        heartbeat is unreadable (then every waiting rank does, as nobody can know better).
        """
        beats = self.heartbeats()
        now = time.time()
        absent = [b for b in beats.values() if b is not None and b.seq < seq]
        unknown = [rank for rank, b in beats.items() if b is None]
        waiting = [rank for rank, b in beats.items() if b is not None and b.waiting == seq]
        parts = [f"collective #{seq} ({name}) has waited {waited:.1f} s"]
        if absent:
            parts.append("not arrived: " + ", ".join(
                f"rank {b.rank} on {b.host} (pid {b.pid}; last entered "
                + (f"#{b.seq} {b.name} {now - b.time:.1f} s ago)" if b.seq else "none)")
                for b in absent))
        if unknown:
            parts.append(f"no heartbeat from rank(s) {', '.join(map(str, unknown))} "
                         f"(is {self.directory} on a filesystem all nodes share?)")
        if not absent and not unknown:
            parts.append("every rank has entered it (the stall is inside MPI or the network)")
        should_print = bool(unknown) or not waiting or min(waiting) >= self.rank
        return should_print, "; ".join(parts)

    # ------------------------------------------------------------------ the thread
    def _say(self, line):
        stream = self._stream or sys.stderr
        try:
            stream.write(f"[pacmpi watchdog rank {self.rank}/{self.size} on {self.host}] {line}\n")
            stream.flush()
        except (OSError, ValueError):
            pass

    def _resolve(self):
        """Say that the collective warned about has completed (main thread or watchdog)."""
        with self._lock:
            warned = self._warned
            if warned is None or warned is self._waiting:
                return
            self._warned = None
        self._say(f"collective #{warned[0]} ({warned[1]}) completed after about "
                  f"{time.monotonic() - warned[2]:.1f} s")

    def _run(self):
        checked = None  # the wait already checked against warn_after
        flushed_seq = None
        while not self._stop.wait(self.poll_interval):
            if self._seq != flushed_seq:
                flushed_seq = self._seq
                self._map.flush()  # msync: lets shared filesystems publish the heartbeat
            current = self._waiting
            if self._warned is not None:
                self._resolve()  # in case the wait ended while the warning was being written
            if current is None:
                continue
            seq, name, started = current
            waited = time.monotonic() - started
            if self.abort_after is not None and waited >= self.abort_after:
                _, line = self.describe(seq, name, waited)
                self._say(f"{line}; aborting the job after abort_after={self.abort_after} s")
                abort_job(self.abort_code)
            if waited >= self.warn_after and checked is not current:
                checked = current
                should_print, line = self.describe(seq, name, waited)
                if should_print:
                    self._say(line)
                    with self._lock:
                        self._warned = current

    def close(self):
        """Stop the thread and remove this rank's heartbeat file (also run at exit)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self._waiting = None
        self._resolve()
        self._slots.release()
        self._map.close()
        try:
            os.unlink(self._path)
            os.rmdir(self.directory)  # succeeds for the last rank to leave
        except OSError:
            pass
        atexit.unregister(self.close)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
