"""A :class:`pacmpi.Collectives` transport over a ``torch.distributed`` process group, so
pacmpi's engine verifies and agrees through the same group DDP uses (gloo or NCCL)."""
import contextlib
from types import SimpleNamespace

import torch
import torch.distributed as dist

from pacmpi import Collectives
from pacmpi.adapters.convert import as_tensor
from pacmpi.collectives import block_bounds, check_blocks

__all__ = ["TorchDistCollectives"]


class TorchDistCollectives(Collectives):
    """:class:`pacmpi.Collectives` over a ``torch.distributed`` process group (default: the
    world), in place on NumPy/CuPy arrays. With NCCL, host arrays are staged through ``device``
    (default: the current CUDA device), which is also made current for object gathers."""

    word_dtypes = ("int64", "int32")

    def __init__(self, process_group=None, device=None):
        self.group = process_group
        self.rank, self.size = dist.get_rank(process_group), dist.get_world_size(process_group)
        self._nccl = dist.get_backend(process_group) == "nccl"
        self.device = torch.device(device if device is not None else
                                   torch.cuda.current_device() if self._nccl else "cpu")

    def _start(self, buf, call):
        tensor = as_tensor(buf)
        if not (self._nccl and tensor.device.type == "cpu"):
            return call(tensor)  # a torch Work: wait() completes it
        staged = tensor.to(self.device)
        work = call(staged)
        return SimpleNamespace(wait=lambda: (work.wait(), tensor.copy_(staged)))

    @staticmethod
    def _op(op):
        if op not in ("sum", "max"):
            raise ValueError(f"op must be 'sum' or 'max', got {op!r}")
        return dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX

    def iallreduce(self, buf, op="sum", name=None):
        kind = self._op(op)
        return self._start(buf, lambda t: dist.all_reduce(t, kind, self.group, async_op=True))

    def _device_for(self, tensor):
        """Where ``tensor``'s data goes on the wire: ``device`` for host tensors under NCCL."""
        return self.device if self._nccl and tensor.device.type == "cpu" else tensor.device

    def _staged(self, tensor):
        return tensor.to(self._device_for(tensor))

    def reduce_scatter(self, buf, out, counts, op="sum", name=None):
        check_blocks(self, counts, buf, out)
        kind, target = self._op(op), as_tensor(out)
        blocks = list(torch.split(self._staged(as_tensor(buf)), [int(c) for c in counts]))
        result = self._staged(target)
        dist.reduce_scatter(result, blocks, kind, group=self.group)  # uneven blocks: fine
        if result is not target:
            target.copy_(result)

    def allgather(self, buf, counts, name=None):
        """Blocks padded to the largest count: torch's all-gathers take equal sizes only
        (gloo rejects uneven ones), so the wire carries up to ``size - 1`` spare elements per
        rank."""
        start, stop = check_blocks(self, counts, buf)
        width = max(int(c) for c in counts)
        if not width:
            return
        tensor = as_tensor(buf)
        mine = torch.zeros(width, dtype=tensor.dtype, device=self._device_for(tensor))
        mine[:stop - start] = tensor[start:stop]
        gathered = mine.new_empty(self.size * width)
        dist.all_gather_single(gathered, mine, group=self.group)
        gathered = gathered.view(self.size, width)
        for owner, (a, b) in enumerate(block_bounds(counts)):
            tensor[a:b] = gathered[owner, :b - a]

    def allreduce(self, buf, op="sum", name=None):
        self.iallreduce(buf, op).wait()

    def bcast(self, buf, root=0, name=None):
        self._start(buf, lambda t: dist.broadcast(t, group=self.group, group_src=root,
                                                  async_op=True)).wait()

    def allgather_object(self, obj, name=None):
        out = [None] * self.size
        with torch.cuda.device(self.device) if self._nccl else contextlib.nullcontext():
            dist.all_gather_object(out, obj, group=self.group)
        return out
