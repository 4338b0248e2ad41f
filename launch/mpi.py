"""Detect the MPI implementation behind ``mpirun`` and build its command line.

Each implementation spells the same intent differently; this module is the one place that
knows the spellings (Open MPI 5 / Open MPI 4 / MPICH and Intel MPI):

- rank count: ``-n N`` everywhere;
- run as root: ``--allow-run-as-root`` (Open MPI only; the others do not refuse root);
- more ranks than cores: ``--oversubscribe`` (Open MPI only);
- tagged output: ``--output tag`` / ``--tag-output`` / ``-prepend-rank``;
- forward a variable: ``-x NAME`` / ``-x NAME`` / ``-genvlist A,B``;
- set a variable: ``-x NAME=VALUE`` / ``-x NAME=VALUE`` / ``-genv NAME VALUE``;
- host file: ``--hostfile F`` / ``--hostfile F`` / ``-f F``;
- TCP only, on one interface: ``--mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include IF
  --mca oob_tcp_if_include IF`` / same / ``-iface IF`` plus no-shared-memory variables.

``horovodrun`` is built separately (:func:`build_horovodrun_command`); it defaults to its Gloo
controller because ``horovodrun --mpi`` passes Open MPI 4-only flags that Open MPI 5 rejects.
``torchrun`` too (:func:`build_torchrun_command`): one node, ``--standalone`` rendezvous.
"""
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .launchers import find_launcher

__all__ = ["MPIFlavor", "MPIDetectionError", "detect_mpi", "build_mpirun_command",
           "build_horovodrun_command", "build_torchrun_command", "ring_collectives_env",
           "allreduce_pin", "ALLREDUCE_CHOICES", "PMIX_LISTENER_FAILED", "remove_session_dirs",
           "session_dir"]

OPENMPI, MPICH, INTEL = "openmpi", "mpich", "intel"


class MPIDetectionError(RuntimeError):
    """``mpirun`` is missing or its ``--version`` output names no implementation we know."""


@dataclass(frozen=True)
class MPIFlavor:
    """An MPI implementation: ``kind`` is ``"openmpi"``, ``"mpich"`` or ``"intel"``;
    ``version`` a tuple of ints (may be empty when the banner has none); ``mpirun`` the
    launcher to call (as given, or an absolute path)."""

    kind: str
    version: tuple = ()
    mpirun: str = "mpirun"

    @property
    def major(self):
        """Major version, 0 when unknown."""
        return self.version[0] if self.version else 0

    @property
    def name(self):
        """The implementation's name as its vendor spells it (and mpi4py reports it)."""
        return {OPENMPI: "Open MPI", MPICH: "MPICH", INTEL: "Intel MPI"}[self.kind]

    def describe(self):
        """Human-readable name, e.g. ``Open MPI 5.0.11``."""
        return f"{self.name} {'.'.join(map(str, self.version))}".strip()


#: What Open MPI 5's launcher prints, exiting with status 213, when it cannot bind its PMIx
#: rendezvous (see :func:`remove_session_dirs`).
PMIX_LISTENER_FAILED = "The PMIx server's listener thread failed to start"


def session_dir(pid):
    """Where Open MPI 5's launcher (prterun) with pid ``pid`` keeps its session: its PMIx
    rendezvous socket and job data, ``$TMPDIR/ompi.PID``."""
    return Path(tempfile.gettempdir()) / f"ompi.{pid}"


def remove_session_dirs(pids):
    """Remove what Open MPI's launcher left in the temporary directory when it was SIGKILLed.

    prterun removes its :func:`session_dir` when it ends, but not when it is SIGKILLed. A later
    launcher that the kernel gives the same pid (pids wrap at 32768 by default) cannot bind
    there and exits with status 213 (:data:`PMIX_LISTENER_FAILED`): one job fails, long after
    the one that was killed. Call this with the pids of processes known to be gone.
    """
    for pid in pids:
        shutil.rmtree(session_dir(pid), ignore_errors=True)


def _version(text):
    match = re.search(r"(\d+(?:\.\d+)+)", text)
    return tuple(int(part) for part in match.group(1).split(".")) if match else ()


def parse_mpi_version(text, mpirun="mpirun"):
    """Return the :class:`MPIFlavor` named by ``mpirun --version`` output ``text``.

    Intel MPI is tested before MPICH because Intel's launcher is Hydra-based too.
    Raises :class:`MPIDetectionError` for anything else.
    """
    intel = re.search(r"Intel\(R\) MPI Library.*?Version\s+(\S+)", text)
    if intel:
        return MPIFlavor(INTEL, _version(intel.group(1)), mpirun)
    ompi = re.search(r"\(Open MPI\)\s*(\S+)|Open MPI\D*(\d\S*)", text)
    if ompi:
        return MPIFlavor(OPENMPI, _version(ompi.group(1) or ompi.group(2)), mpirun)
    if "HYDRA" in text:
        version = re.search(r"Version:\s*(\S+)", text)
        return MPIFlavor(MPICH, _version(version.group(1)) if version else (), mpirun)
    first = text.strip().splitlines()[0] if text.strip() else "(no output)"
    raise MPIDetectionError(f"{mpirun} --version names no MPI that pacmpi-run knows: {first!r}")


def detect_mpi(mpirun=None):
    """Run ``mpirun --version`` and return its :class:`MPIFlavor`.

    ``mpirun`` is a path or a bare name (``mpiexec``); ``None`` means ``$PACMPI_MPIRUN``, then
    the running Python's ``bin``, then ``PATH`` (see :mod:`.launchers`). Raises
    :class:`~.launchers.LauncherNotFoundError` (listing where it looked) when there is none,
    :class:`MPIDetectionError` when its banner names no MPI we know.
    """
    path = find_launcher("mpirun", mpirun, option="--mpirun")
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired as exc:
        raise MPIDetectionError(f"{path} --version did not answer within 30 s") from exc
    return parse_mpi_version(done.stdout + done.stderr, path)


def _split_env(entries):
    """Split ``NAME`` / ``NAME=VALUE`` entries into (names to forward, {name: value} to set)."""
    names, values = [], {}
    for entry in entries:
        name, sep, value = entry.partition("=")
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"bad environment variable entry {entry!r}: "
                             "expected NAME or NAME=VALUE")
        if sep:
            values[name] = value
        else:
            names.append(name)
    return names, values


def build_mpirun_command(flavor, n, argv, *, oversubscribe=False, allow_root=None,
                         env_forward=(), tag_output=True, hostfile=None, extra_mca=None,
                         tcp_only_interface=None, bind_to=None):
    """Return the ``mpirun`` argument list that starts ``argv`` on ``n`` ranks.

    Knobs:
      ``oversubscribe``   allow more ranks than cores (Open MPI refuses otherwise); also sets
                          ``mpi_yield_when_idle 1``, Open MPI's advice for oversubscribed
                          nodes: ranks waiting in a collective yield their core to the rank
                          still computing (on the 2-core test bed, 4 ranks, it made no
                          difference beyond run-to-run noise).
      ``allow_root``      add Open MPI's root flag; ``None`` means "when ``os.geteuid() == 0``".
      ``env_forward``     entries ``NAME`` (forward the launcher's value) or ``NAME=VALUE``
                          (set it), for every rank on every node.
      ``tag_output``      prefix every output line with its rank.
      ``hostfile``        host file for multi-node runs.
      ``extra_mca``       ``{param: value}`` Open MPI MCA parameters (ignored by other MPIs;
                          pass their knobs through ``env_forward`` as ``NAME=VALUE``).
      ``tcp_only_interface``  force all rank-to-rank traffic, also between ranks on one host,
                          over TCP on this interface (no shared memory): what the
                          bandwidth-limited test bed needs so that bytes cross the shaped link.
                          An interface name or a subnet (``198.18.0.0/15``: Open MPI only).
      ``bind_to``         process binding (``core``, ``none``, ...; Open MPI only): the node
                          test bed's daemons each see every core and would all bind to core 0.
    """
    if n < 1:
        raise ValueError(f"rank count must be at least 1, got {n}")
    if not argv:
        raise ValueError("no command to run")
    if allow_root is None:
        allow_root = os.geteuid() == 0
    names, values = _split_env(env_forward)
    cmd = [flavor.mpirun, "-n", str(n)]
    if flavor.kind == OPENMPI:
        if allow_root:
            cmd.append("--allow-run-as-root")
        if oversubscribe:
            cmd.append("--oversubscribe")
        if tag_output:
            cmd += ["--output", "tag"] if flavor.major >= 5 else ["--tag-output"]
        if hostfile:
            cmd += ["--hostfile", str(hostfile)]
        if bind_to:
            cmd += ["--bind-to", bind_to]
        for entry in env_forward:
            cmd += ["-x", entry]
        mca = {"mpi_yield_when_idle": 1} if oversubscribe else {}
        if tcp_only_interface:
            # ob1 + tcp,self leaves out the shared-memory BTL, so same-host ranks talk over TCP;
            # Open MPI excludes lo from TCP by default, so include the interface explicitly.
            mca.update({"pml": "ob1", "btl": "tcp,self",
                        "btl_tcp_if_include": tcp_only_interface,
                        "oob_tcp_if_include": tcp_only_interface})
        mca.update(extra_mca or {})
        for key, value in mca.items():
            cmd += ["--mca", key, str(value)]
    else:
        if tcp_only_interface:
            cmd += ["-iface", tcp_only_interface]
            # Without this, same-host ranks use shared memory and bypass the shaped link.
            values = {**_NO_SHM_ENV[flavor.kind], **values}
        if tag_output:
            cmd.append("-prepend-rank")
        if hostfile:
            cmd += ["-f", str(hostfile)]
        if names:
            cmd += ["-genvlist", ",".join(names)]
        for name, value in values.items():
            cmd += ["-genv", name, value]
    return cmd + list(argv)


# Environment that makes MPICH (ch4 and ch3) and Intel MPI treat every peer as remote.
_NO_SHM_ENV = {
    MPICH: {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH3_NOLOCAL": "1"},
    INTEL: {"I_MPI_FABRICS": "ofi", "FI_PROVIDER": "tcp"},
}


ALLREDUCE_CHOICES = ("auto", "ring", "default")

# The ring, by the settings that choose each collective's algorithm, as environment variables
# (Open MPI reads OMPI_MCA_<param> like --mca <param>; its numbers differ per collective): the
# all-reduce, and the all-gathers of the peers (TopK, DGC, TernGrad) and of sharding. Open MPI
# runs the non-blocking all-reduce (the reducer's packed Iallreduce) in coll/libnbc, not
# coll/tuned: left to itself libnbc takes a binomial tree for an in-place buffer, which on
# per-node links moves each byte 2 log2(n) times where the ring moves it 2(n-1)/n times.
# MPICH chooses it in its own variable too; its ring there is tsp_ring from MPICH 4 (3.x
# spelled it gentran_ring, and an unknown value aborts MPI_Init).
_RING = {
    OPENMPI: ("OMPI_MCA_coll_tuned_use_dynamic_rules=1",
              "OMPI_MCA_coll_tuned_allreduce_algorithm=4",
              "OMPI_MCA_coll_tuned_allgather_algorithm=4",
              "OMPI_MCA_coll_tuned_allgatherv_algorithm=3",
              "OMPI_MCA_coll_libnbc_iallreduce_algorithm=1"),
    MPICH: ("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring",
            "MPIR_CVAR_ALLGATHER_INTRA_ALGORITHM=ring",
            "MPIR_CVAR_ALLGATHERV_INTRA_ALGORITHM=ring",
            "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=tsp_ring"),
}
# One of these set by the user means the choice of algorithms is theirs.
_ALGORITHM_SETTINGS = {
    OPENMPI: tuple(e.partition("=")[0] for e in _RING[OPENMPI])
    + ("OMPI_MCA_coll_tuned_dynamic_rules_filename",),
    MPICH: tuple(e.partition("=")[0] for e in _RING[MPICH]),
}


def ring_collectives_env(flavor):
    """``NAME=VALUE`` entries that make every rank run the ring all-reduce and all-gathers, or
    ``[]``.

    The test bed's link model assumes every rank sends 2(n-1)/n of the buffer, which is the
    ring's traffic; Open MPI's default choice moved more for 3 ranks (88% of nominal instead
    of 99%) and took 1.73x as long on the star bed. The cost model's all-gather is the ring's
    too ((n-1) blocks per rank): Open MPI's default all-gather ran TopK's 16-48% over it at 3-8
    nodes. Environment variables, not ``--mca`` flags: they reach the ranks under every
    launcher (``mpirun -x``, torchrun's and horovodrun's inherited environment, the node test
    bed's remote daemons). Intel MPI has no documented stable id for the ring; its default is
    used and the calibration's tolerance check catches a mismatch.
    """
    ring = list(_RING.get(flavor.kind, ()))
    if flavor.kind == MPICH and 0 < flavor.major < 4:
        ring.remove("MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=tsp_ring")
    return ring


def users_allreduce_setting(flavor, env_entries=(), extra_mca=None, environ=None):
    """How the user chose the all-reduce algorithm themselves, as they spelled it
    (``"-x OMPI_MCA_coll_tuned_allreduce_algorithm=2"``, ``"--mca ..."``, ``"$NAME=VALUE in the
    environment"``), or ``None``: a ``-x`` entry, an MCA parameter, or a variable already in
    ``environ`` (``os.environ``: the launchers pass it on to the ranks)."""
    names = _ALGORITHM_SETTINGS.get(flavor.kind, ())
    for entry in env_entries:
        if entry.partition("=")[0] in names:
            return f"-x {entry}"
    for key, value in (extra_mca or {}).items():
        if f"OMPI_MCA_{key}" in names:
            return f"--mca {key} {value}"
    environ = os.environ if environ is None else environ
    for name in names:
        if name in environ:
            return f"${name}={environ[name]} in the environment"
    return None


def allreduce_pin(flavor, choice, *, testbed, env_entries=(), extra_mca=None, environ=None):
    """``(entries, note)``: the ``NAME=VALUE`` entries to add to every rank's environment for
    the all-reduce ``choice`` (one of :data:`ALLREDUCE_CHOICES`) and a line saying why.

    ``"auto"``: the ring on the test bed (what its calibration measured), unless the user chose
    an algorithm (:func:`users_allreduce_setting`), which then wins; nothing off the test bed.
    ``"ring"``: the ring, also off the test bed; a conflicting setting of the user's is an
    error. ``"default"``: nothing, the MPI library chooses. ``flavor`` ``None``: no MPI found
    (a torchrun or horovodrun job), nothing to pin.
    """
    if choice not in ALLREDUCE_CHOICES:
        raise ValueError(f"all-reduce algorithm {choice!r}: choose one of "
                         f"{', '.join(ALLREDUCE_CHOICES)}")
    if flavor is None or choice == "default" or (choice == "auto" and not testbed):
        if choice == "default" and testbed:
            return [], ("--allreduce-algorithm default: the MPI library chooses the job's "
                        "all-reduce; the calibration measured the ring")
        return [], None
    users = users_allreduce_setting(flavor, env_entries, extra_mca, environ)
    ring = ring_collectives_env(flavor)
    if choice == "ring" and (users or not ring):
        raise ValueError(f"--allreduce-algorithm ring conflicts with your {users}; drop one"
                         if users else
                         f"--allreduce-algorithm ring: no known setting selects the ring in "
                         f"{flavor.name}")
    if users:
        return [], (f"the all-reduce algorithm is yours ({users}): no ring pin, though the "
                    "calibration measured the ring")
    if not ring:
        return [], (f"{flavor.name} has no known setting for the ring all-reduce: the job "
                    "runs its default, the calibration checks the link")
    why = ("the test bed's calibration measured the ring all-reduce" if testbed else
           "--allreduce-algorithm ring")
    return ring, (f"{why}: every rank gets {' '.join(ring)} (--allreduce-algorithm default "
                  f"leaves the choice to {flavor.name})")


def build_horovodrun_command(n, argv, *, gloo=True, hosts=None, network_interface=None,
                             horovodrun="horovodrun"):
    """Return the ``horovodrun`` argument list that starts ``argv`` on ``n`` ranks.

    ``gloo`` selects Horovod's Gloo controller (default; ``--mpi`` breaks with Open MPI 5);
    ``hosts`` is horovodrun's ``-H`` list (default ``localhost:n``); ``network_interface``
    pins Horovod's traffic to one NIC (the test bed uses ``lo``).
    """
    if n < 1:
        raise ValueError(f"rank count must be at least 1, got {n}")
    if not argv:
        raise ValueError("no command to run")
    cmd = [horovodrun, "--gloo" if gloo else "--mpi", "-np", str(n),
           "-H", hosts or f"localhost:{n}"]
    if network_interface:
        cmd += ["--network-interface", network_interface]
    return cmd + list(argv)


def build_torchrun_command(n, argv, *, torchrun="torchrun", env_forward=(), socket_ifname=None,
                           nodes=None):
    """Return the ``torchrun`` argument list that starts ``argv`` on ``n`` ranks of this node.

    ``torchrun --standalone --nproc-per-node N --no-python ARGV``: a local c10d rendezvous on
    a free port, and ``argv`` run as a command (``python t.py``, ``pacmpi train ...``), as
    under ``mpirun``. Workers inherit torchrun's environment, so ``env_forward`` entries
    ``NAME`` need nothing and ``NAME=VALUE`` entries become an ``env NAME=VALUE`` prefix (the
    printed command then does what is run). ``socket_ifname`` pins gloo (and NCCL's
    bootstrap) to one interface, ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``: the test bed
    uses ``lo``. ``nodes``: ``(K, MASTER_ADDR, MASTER_PORT)`` for one node of a K-node job
    (torchrun's static rendezvous: ``--nnodes K --master-addr A --master-port P``; the node's
    rank comes from ``PET_NODE_RANK``, torchrun's environment form of ``--node-rank``, so one
    command serves every node); the node test bed runs it on each node.
    """
    if n < 1:
        raise ValueError(f"rank count must be at least 1, got {n}")
    if not argv:
        raise ValueError("no command to run")
    _, values = _split_env(env_forward)
    if socket_ifname:
        values = {**values, "GLOO_SOCKET_IFNAME": socket_ifname,
                  "NCCL_SOCKET_IFNAME": socket_ifname}
    prefix = ["env", *(f"{name}={value}" for name, value in values.items())] if values else []
    if nodes is None:
        where = ["--standalone"]
    else:
        count, address, port = nodes
        where = ["--nnodes", str(count), "--master-addr", str(address), "--master-port",
                 str(port)]
    return prefix + [torchrun, *where, "--nproc-per-node", str(n), "--no-python", *argv]
