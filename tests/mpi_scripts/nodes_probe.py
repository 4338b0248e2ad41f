"""Where each rank runs on the node test bed, and an exact all-reduce across the nodes.

Usage: nodes_probe.py [KILL_RANK]

Every rank prints one line ``NODEPROBE {json}``: its rank, world size, host name, network
namespace, IPv4 addresses, the size of its node-local communicator (MPI's view of "same
node"), whether a float64 all-reduce of integer-valued data equalled the exact sum, and the
all-reduce algorithm the MPI library was told to use (read back from it through MPI_T).
With KILL_RANK, that rank SIGKILLs itself before any communication and the rest wait,
touching no peer: the launcher has to end the job and report the dead rank. (Waiting in a
barrier instead raced: a rank's connection to the dead one is refused, and its own abort could
reach the launcher before the kill did.)
"""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

from pacmpi.collectives import allreduce_algorithm

comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
if len(sys.argv) > 1:
    if rank == int(sys.argv[1]):
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(50)  # ended by the launcher long before; the caller's timeout is 60 s
    sys.exit(0)

# Integer-valued floats: every partial sum is exact, so any reduction order gives this value.
ramp = np.arange(100_003, dtype=np.float64)
total = np.empty_like(ramp)
comm.Allreduce(ramp * (rank + 1), total, op=MPI.SUM)
exact = bool(np.array_equal(total, ramp * (size * (size + 1) // 2)))
local = comm.Split_type(MPI.COMM_TYPE_SHARED)
addresses = subprocess.run(["ip", "-4", "-o", "addr", "show"], capture_output=True, text=True,
                           check=True).stdout.split()
namespace = subprocess.run(["ip", "netns", "identify"], capture_output=True, text=True,
                           check=True).stdout.strip()
print("NODEPROBE " + json.dumps({
    "rank": rank, "size": size, "host": MPI.Get_processor_name(), "namespace": namespace,
    "addresses": sorted(a.split("/")[0] for i, a in enumerate(addresses)
                        if addresses[i - 1] == "inet"),
    "local_size": local.Get_size(), "exact": exact,
    "algorithm": allreduce_algorithm(MPI)}), flush=True)
