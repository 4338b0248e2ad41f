"""Where each torchrun worker runs on the node test bed, and an exact gloo all-reduce across
the nodes that crosses the node's link.

Every worker prints one line ``TORCHPROBE {json}``: its rank, world size, local rank, host
name, whether MPI's launch variables reached it (they must not: the workers are no MPI
processes), whether an all-reduce of integer-valued float64 data equalled the exact sum, and
how many bytes its node's link (``eth0``) sent during that all-reduce. Ranks of a node share
its ``eth0``, so the counter is the node's, not the worker's.
"""
import json
import os
import socket

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
link = "/sys/class/net/eth0/statistics/tx_bytes"


def sent():
    with open(link) as counter:
        return int(counter.read())


ramp = torch.arange(1 << 18, dtype=torch.float64)
total = ramp * (rank + 1)
dist.barrier()
before = sent()
dist.all_reduce(total)
after = sent()
# One write per line: the node's workers share torchrun's stdout, and under PYTHONUNBUFFERED
# print() writes the text and its newline apart, so two workers' lines could interleave.
line = "TORCHPROBE " + json.dumps({
    "rank": rank, "size": size, "local_rank": int(os.environ["LOCAL_RANK"]),
    "host": socket.gethostname(),
    "mpi_variables": sorted(k for k in os.environ if k.startswith(("OMPI_COMM_", "PMIX_RANK"))),
    "exact": bool(torch.equal(total, ramp * (size * (size + 1) // 2))),
    "link_bytes": after - before, "payload_bytes": ramp.numel() * ramp.element_size()})
os.write(1, (line + "\n").encode())
dist.destroy_process_group()
