"""K simulated nodes on one machine, each with its own shaped link, and a real multi-host launch.

Every node is a network namespace (``PREFIX-nI``) whose only interface besides ``lo`` is
``eth0``, one end of a veth pair; the other end (``pI``) is a port of a bridge in a switch
namespace (``PREFIX-sw``). Node I has the address ``198.18.0.(I+1)/15`` (RFC 2544's benchmark
range, never routed) and no default route, so it can reach the other nodes over its link and
nothing else: :meth:`NodeTestbed.check_isolation` checks exactly that after set-up.

Topologies:

- ``star`` (the paper's): a tbf on both ends of every veth, the node end's egress (uplink)
  and the switch port's egress (downlink), so each node has a private full-duplex RATE link.
  A ring all-reduce of S bytes over K nodes then takes 2(K-1)/K * S / RATE.
- ``shared`` (as :class:`~.testbed.LinkTestbed`, across nodes): every frame entering the
  switch is redirected (``tc ... action mirred``) through one ``ifb`` device shaped to RATE,
  one queue for all traffic: the same ring takes 2(K-1) * S / RATE.

The launch is Open MPI's own multi-host path: ``mpirun`` runs inside node 0 (host name
``node0``) with a generated host file (``nodeI slots=P``: P ranks per node, rank R on node
R // P) and ``--mca plm_rsh_agent AGENT``. Open MPI starts its daemon on each other node by
running ``AGENT nodeI COMMAND``, as it would run ``ssh``; the generated agent runs COMMAND in
nodeI's namespace, with host name ``nodeI`` (its own UTS namespace, so Open MPI tells nodes
apart and its reports name them). Host names need no resolver: only the agent reads them.
TCP is pinned to 198.18.0.0/15 (``btl tcp,self``, ``btl_tcp_if_include``,
``oob_tcp_if_include``), with two connections per pair of ranks and eager messages up to 1 MiB
(``TCP_SETTINGS``: why, there) and binding is off (``--bind-to none``: every daemon sees all cores
and would bind its ranks to the same one). Ranks on one node talk over that node's ``lo``,
unshaped, as over a real node's memory; everything between nodes crosses two shaped queues.

A node whose link is down cannot start: its daemon never connects back and the run ends
with Open MPI's "daemon failed to report back" report, which :func:`parse_daemon_failure`
turns into the node's name.
"""
import ipaddress
import re

from .mpi import OPENMPI, build_mpirun_command, build_torchrun_command
from .testbed import TOPOLOGIES, NamespaceBed, TestbedError, format_rate, run_setup, tbf_command

__all__ = ["NodeTestbed", "parse_daemon_failure", "describe_daemon_failure"]

NODE_SUBNET = ipaddress.IPv4Network("198.18.0.0/15")
NODE_INTERFACE = "eth0"
BRIDGE = "br0"
SHARED_QUEUE = "ifb0"
# Open MPI TCP settings for jobs on the nodes (measured on 2 cores, see docs/testbed.md):
# - two connections per pair of ranks: over one, a 2-node ring all-reduce ran at 49-63% of
#   what two full-duplex links carry, as if one direction waited for the other; over two, 99%;
# - messages up to 1 MiB sent eagerly: a rendezvous handshake waits behind the bulk data that
#   fills the peer's shaped uplink, once per ring step; an 8-node ring went from 64% to 89%.
#   (4 MiB helped 8 nodes as much but cost 2 nodes 99% -> 75%: one 3 MiB eager fragment per
#   direction, so the two connections no longer share the load.)
# torchrun's static rendezvous (its TCPStore) on node 0; the port is free in a fresh namespace.
TORCHRUN_PORT = 29500
TCP_SETTINGS = {"btl_tcp_links": "2", "btl_tcp_eager_limit": str(1 << 20),
                "btl_tcp_rndv_eager_limit": str(1 << 20), "btl_tcp_max_send_size": str(1 << 20)}


class NodeTestbed(NamespaceBed):
    """Context manager for ``nodes`` simulated nodes behind a switch, links shaped to ``rate``.

    ``topology``: ``"star"`` (a private RATE link per node, both directions) or ``"shared"``
    (one RATE queue for all traffic). ``burst``, ``latency``, ``mtu`` (of every veth) and
    ``mpirun`` as for :class:`~.testbed.LinkTestbed`.

    Use :meth:`mpirun_command` to build a job's command (run it as is, from the host),
    :meth:`calibrate` to measure the links (one rank per node), ``hosts``/``addresses``/
    ``node_namespaces`` to name what is where, :meth:`node_of_rank` for the placement.
    """

    option = "--nodes"
    tools = NamespaceBed.tools + (("unshare", "util-linux"), ("hostname", "hostname"))

    def __init__(self, nodes, rate, *, topology="star", burst="64kb", latency="200ms", mtu=9000,
                 mpirun=None):
        if not isinstance(nodes, int) or not 2 <= nodes <= NODE_SUBNET.num_addresses - 2:
            raise ValueError(f"bad node count {nodes!r}: expected an integer from 2 to "
                             f"{NODE_SUBNET.num_addresses - 2}")
        if topology not in TOPOLOGIES:
            raise ValueError(f"bad topology {topology!r}: expected one of {', '.join(TOPOLOGIES)}")
        super().__init__(rate, burst=burst, latency=latency, mtu=mtu, mpirun=mpirun)
        self.nodes, self.topology = nodes, topology
        self.switch = f"{self.name}-sw"
        self.node_namespaces = [f"{self.name}-n{i}" for i in range(nodes)]
        self.hosts = [f"node{i}" for i in range(nodes)]
        self.addresses = [str(NODE_SUBNET[i + 1]) for i in range(nodes)]
        self.agent = self.workdir / "rsh-agent"
        self.torchrun_node = self.workdir / "torchrun-node"
        self._hostfiles = {}  # path -> text, written on entry (commands are built before it)

    @property
    def namespaces(self):
        return (self.switch, *self.node_namespaces)

    def _setup_steps(self):
        switch = ["ip", "netns", "exec", self.switch]
        shape = ("could not attach the tbf qdisc (kernel without sch_tbf, or a bad "
                 "burst/latency value?)")
        steps = [
            (["ip", "netns", "add", self.switch],
             "could not create the switch's network namespace (is this a container without "
             "CAP_SYS_ADMIN?)"),
            (switch + ["ip", "link", "add", BRIDGE, "type", "bridge"],
             "could not create the switch's bridge (kernel without bridge support?)"),
            (switch + ["ip", "link", "set", BRIDGE, "up"], "could not bring up the bridge"),
        ]
        if self.topology == "shared":
            steps += [
                (switch + ["ip", "link", "add", SHARED_QUEUE, "type", "ifb"],
                 "could not create the shared queue's ifb device (kernel without ifb?)"),
                (switch + ["ip", "link", "set", SHARED_QUEUE, "up"], "could not bring up ifb0"),
                (tbf_command(self.rate_bps, SHARED_QUEUE, self.burst, self.latency, self.switch),
                 shape),
            ]
        for i, (namespace, address) in enumerate(zip(self.node_namespaces, self.addresses)):
            node, port = ["ip", "netns", "exec", namespace], f"p{i}"
            steps += [
                (["ip", "netns", "add", namespace], f"could not create node {i}'s namespace"),
                (node + ["ip", "link", "set", "lo", "up"], f"could not bring up node {i}'s lo"),
                (["ip", "link", "add", NODE_INTERFACE, "netns", namespace, "type", "veth",
                  "peer", "name", port, "netns", self.switch],
                 f"could not create node {i}'s veth pair (kernel without veth?)"),
                (node + ["ip", "link", "set", NODE_INTERFACE, "mtu", str(self.mtu)],
                 f"could not set node {i}'s MTU to {self.mtu}"),
                (switch + ["ip", "link", "set", port, "mtu", str(self.mtu)],
                 f"could not set switch port {port}'s MTU to {self.mtu}"),
                (node + ["ip", "addr", "add", f"{address}/{NODE_SUBNET.prefixlen}", "dev",
                         NODE_INTERFACE], f"could not give node {i} the address {address}"),
                (node + ["ip", "link", "set", NODE_INTERFACE, "up"],
                 f"could not bring up node {i}'s link"),
                (switch + ["ip", "link", "set", port, "master", BRIDGE],
                 f"could not attach node {i}'s link to the bridge"),
                (switch + ["ip", "link", "set", port, "up"],
                 f"could not bring up switch port {port}"),
            ]
            if self.topology == "star":
                steps += [
                    (tbf_command(self.rate_bps, NODE_INTERFACE, self.burst, self.latency,
                                 namespace), shape),
                    (tbf_command(self.rate_bps, port, self.burst, self.latency, self.switch),
                     shape),
                ]
            else:
                steps += [
                    (switch + ["tc", "qdisc", "add", "dev", port, "handle", "ffff:", "ingress"],
                     "could not attach an ingress qdisc (kernel without sch_ingress?)"),
                    (switch + ["tc", "filter", "add", "dev", port, "parent", "ffff:", "protocol",
                               "all", "u32", "match", "u32", "0", "0", "action", "mirred",
                               "egress", "redirect", "dev", SHARED_QUEUE],
                     "could not redirect the port into the shared queue (kernel without "
                     "cls_u32/act_mirred?)"),
                ]
        return steps

    def _prepare(self):
        self.workdir.mkdir(mode=0o700)
        for path, text in ((self.agent, self.agent_script()),
                           (self.torchrun_node, self.torchrun_node_script())):
            path.write_text(text)
            path.chmod(0o700)
        for path, text in self._hostfiles.items():
            path.write_text(text)

    def __enter__(self):
        super().__enter__()
        try:
            self.check_isolation()
        except BaseException:
            self.cleanup()
            raise
        return self

    def agent_script(self):
        """The ``plm_rsh_agent`` Open MPI calls as ``AGENT HOST COMMAND...`` (like ``ssh``)."""
        cases = "\n".join(f"    {host}) netns={namespace} ;;"
                          for host, namespace in zip(self.hosts, self.node_namespaces))
        return f"""#!/bin/sh
# Open MPI's remote-launch agent for the pacmpi node test bed {self.name}: runs the command
# (joined into one shell line, as ssh does) in the node's network namespace, with the node's
# host name in a UTS namespace of its own.
host=$1
shift
case "$host" in
{cases}
    *) echo "pacmpi node test bed {self.name}: no node named '$host' ({', '.join(self.hosts)})" >&2
       exit 255 ;;
esac
exec ip netns exec "$netns" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
"""

    def torchrun_node_script(self):
        """What :meth:`torchrun_command` has ``mpirun`` start on each node: that node's
        ``torchrun``, its node rank being the launching rank's."""
        return f"""#!/bin/sh
# One node's torchrun of a torchrun job on the pacmpi node test bed {self.name}: mpirun starts
# this once per node (rank R on node R), and torchrun reads its node rank from PET_NODE_RANK.
# The workers are no MPI processes: Open MPI's and PMIx's variables are dropped, so that a
# worker which loads MPI starts as a singleton instead of claiming this launcher's rank.
export PET_NODE_RANK="$OMPI_COMM_WORLD_RANK"
for name in $(env | sed -n 's/^\\(\\(OMPI\\|PMIX\\|PRTE\\)_[A-Za-z0-9_]*\\)=.*/\\1/p'); do
  unset "$name"
done
exec "$@"
"""

    def torchrun_command(self, flavor, n, argv, *, torchrun="torchrun", env_forward=(),
                         **options):
        """A ``torchrun`` job of ``n`` ranks on the nodes (run it as is, from the host):
        Open MPI's ``mpirun`` (:meth:`mpirun_command`, one rank per node) starts one
        ``torchrun --nnodes K --nproc-per-node n/K`` per node in the node's namespace, with
        the static rendezvous on node 0 and gloo pinned to the node's link, as on K real
        hosts; ``options`` as for :meth:`mpirun_command`."""
        inner = build_torchrun_command(self.ranks_per_node(n), argv, torchrun=torchrun,
                                       env_forward=env_forward, socket_ifname=NODE_INTERFACE,
                                       nodes=(self.nodes, self.addresses[0], TORCHRUN_PORT))
        return self.mpirun_command(flavor, self.nodes, [str(self.torchrun_node), *inner],
                                   **options)

    def wrap(self, cmd, node=0):
        """Return ``cmd`` prefixed so that it runs on ``node`` (its namespace and host name)."""
        return ["ip", "netns", "exec", self.node_namespaces[node], "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hosts[node], *cmd]

    def ranks_per_node(self, n):
        """Ranks on each node for an ``n``-rank job (blocks of equal size)."""
        if n < self.nodes or n % self.nodes:
            raise ValueError(f"bad rank count {n} for {self.nodes} nodes: ranks are placed in "
                             f"equal blocks, so it must be a multiple of {self.nodes}")
        return n // self.nodes

    def node_of_rank(self, rank, n):
        """Index of the node that rank ``rank`` of an ``n``-rank job runs on."""
        return rank // self.ranks_per_node(n)

    def hostfile(self, n):
        """Path of the host file for ``n`` ranks (written now if the test bed is active, else
        when it is entered)."""
        per_node = self.ranks_per_node(n)
        path = self.workdir / f"hostfile-{per_node}"
        self._hostfiles[path] = "".join(f"{host} slots={per_node}\n" for host in self.hosts)
        if self.active:
            path.write_text(self._hostfiles[path])
        return path

    def mpirun_command(self, flavor, n, argv, **options):
        """``build_mpirun_command`` for a job on the nodes, started from node 0 (run it as is).

        ``options`` as for :func:`~.mpi.build_mpirun_command`, less ``hostfile`` (generated),
        ``tcp_only_interface`` and ``bind_to``; ``extra_mca`` is added to the test bed's.
        """
        if flavor.kind != OPENMPI:
            raise TestbedError(f"{self.option} starts one Open MPI daemon per node through "
                               f"plm_rsh_agent; {flavor.describe()} is not Open MPI")
        if options.pop("hostfile", None):
            raise ValueError(f"{self.option} writes its own host file; leave out --hostfile")
        mca = {"plm_rsh_agent": str(self.agent), **TCP_SETTINGS,
               **(options.pop("extra_mca", None) or {})}
        return self.wrap(build_mpirun_command(
            flavor, n, argv, hostfile=self.hostfile(n), tcp_only_interface=str(NODE_SUBNET),
            bind_to="none", extra_mca=mca, **options))

    def notes(self, n, torchrun=False):
        """What the launch adds, in words (shown by ``--dry-run``); ``torchrun``: a
        :meth:`torchrun_command` job (``mpirun`` then starts one launcher per node)."""
        per_node = self.ranks_per_node(n)
        launchers = self.nodes if torchrun else n
        slots = launchers // self.nodes
        notes = [f"{self.nodes} nodes x {per_node} ranks, {self.topology} topology at "
                 f"{format_rate(self.rate_bps)} per link" if self.topology == "star" else
                 f"{self.nodes} nodes x {per_node} ranks, {self.topology} topology: one "
                 f"{format_rate(self.rate_bps)} queue for all traffic",
                 f"host file {self.hostfile(launchers)}: "
                 + ", ".join(f"{host} slots={slots} ({address})"
                             for host, address in zip(self.hosts, self.addresses)),
                 f"plm_rsh_agent {self.agent}: runs each node's Open MPI daemon in its namespace "
                 "(ip netns exec NODE_NAMESPACE unshare --uts ...)"]
        if torchrun:
            notes.append(f"{self.torchrun_node}: mpirun's rank I starts node I's torchrun "
                         f"(--nnodes {self.nodes} --nproc-per-node {per_node}, static "
                         f"rendezvous at {self.addresses[0]}:{TORCHRUN_PORT}, gloo on "
                         f"{NODE_INTERFACE})")
        return notes

    def check_isolation(self):
        """Check that every node has ``lo`` and its link and nothing else, and routes only to
        the node subnet; return ``{host: {"interfaces": [...], "routes": [...]}}``."""
        report = {}
        for host, namespace in zip(self.hosts, self.node_namespaces):
            inside = ["ip", "netns", "exec", namespace, "ip"]
            links = _ip_lines(inside + ["-o", "link", "show"], namespace)
            interfaces = sorted(re.match(r"\d+:\s*([^:@]+)", line).group(1) for line in links)
            routes = _ip_lines(inside + ["-4", "route", "show"], namespace)
            if interfaces != sorted(["lo", NODE_INTERFACE]):
                raise TestbedError(f"{host} ({namespace}) has the interfaces {interfaces}, "
                                   f"expected only lo and {NODE_INTERFACE}")
            bad = [route for route in routes
                   if not route.startswith(f"{NODE_SUBNET} dev {NODE_INTERFACE} ")]
            if bad:
                raise TestbedError(f"{host} ({namespace}) has routes outside its link: {bad}")
            report[host] = {"interfaces": interfaces, "routes": routes}
        return report

    def set_link(self, node, up):
        """Bring node ``node``'s link up or down at the switch (to test what a job does)."""
        state = "up" if up else "down"
        run_setup(["ip", "netns", "exec", self.switch, "ip", "link", "set", f"p{node}", state],
                  f"could not set node {node}'s link {state}")

    def calibrate(self, nbytes=None, repeats=3, *, tolerance=0.15, seconds_per_call=0.5,
                  timeout=120):
        """Measure the links with a ring all-reduce on one rank per node (see
        :meth:`~.testbed.LinkTestbed.calibrate`); ``star``: each node's link must carry
        2(K-1)/K * S bytes per call at RATE, ``shared``: the one queue 2(K-1) * S."""
        return self.calibrate_ranks(self.nodes, nbytes, repeats, tolerance=tolerance,
                                    seconds_per_call=seconds_per_call, timeout=timeout)


def _ip_lines(cmd, namespace):
    return [line for line in run_setup(cmd, f"could not inspect {namespace}").splitlines()
            if line.strip()]


_DAEMON_FAILED = re.compile(r"A daemon failed to report back.*?Remote host:\s*(\S+)")


def parse_daemon_failure(text):
    """The host named by Open MPI's "A daemon failed to report back" report, or ``None``."""
    match = _DAEMON_FAILED.search(" ".join(text.split()))
    return match.group(1) if match else None


def describe_daemon_failure(host, returncode, launcher="mpirun"):
    """One line for the user about a node whose Open MPI daemon never connected back."""
    return (f"pacmpi-run: the Open MPI daemon on {host} never reported back to {launcher} on "
            f"node0: {host} cannot reach node0 over its link (link down?); {launcher} exited "
            f"with status {returncode}")
