"""``python -m pacmpi.experiments.bench_sharded``: optimizer state per rank and bytes per step of
sharded PacTrain (:func:`pacmpi.adapters.sharded.sharded_hook`) against DDP +
``ZeroRedundancyOptimizer`` (dense) and replicated PacTrain (the DDP hook), all with Adam; and
of both PacTrains with ternary codes (the sharded one through ``ShardedOptimizer.step``: its
reduce-scatter carries codes, its all-gather full values).

Run it under torchrun (gloo on CPU): ``torchrun --standalone --nproc-per-node 4 -m
pacmpi.experiments.bench_sharded``. A model of ``--model`` (weights of 2+ dimensions pruned to
``--density`` under random masks; biases and norms kept) trains ``--steps`` steps on random
data with each method; the bytes are the last step's. Columns, per rank (the largest over
ranks):

- ``state``: the optimizer's per-coordinate state (Adam's two moments) in elements and bytes;
- ``kept``: what pacmpi keeps besides, in bytes (the ``memory_report()`` of the sharded
  reducer or of the replicated hook's engine: survivor indices, mask snapshots, buffers);
  ZeRO's own buffers are not counted ("-");
- payload bytes per step by collective (what each rank hands to it: the all-reduce's buffer,
  the reduce-scatter's input, the all-gather's output -- torch's, padded to the largest
  shard --, ZeRO's broadcasts of every partition);
- ``wire``: the bytes a rank sends per step under the ring model (an all-reduce of B sends
  2(N-1)/N B; a reduce-scatter, an all-gather or the broadcasts of a partitioned B send
  (N-1)/N B), so the methods compare on any transport;
- ``max |w - replicated|``: the largest weight difference from replicated PacTrain after the
  steps (0 up to the order of the sums: sharding is lossless); the ternary rows against
  replicated ternary PacTrain (other keys: the hook's buckets are not the shard's one).

No times: the sizes do not depend on the machine; time to accuracy is the training job's.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook
from pacmpi.adapters.sharded import ShardedOptimizer, sharded_hook
from pacmpi.adapters.torch_collectives import TorchDistCollectives
from pacmpi.bench import harness
from pacmpi.experiments.models import build_model
from pacmpi.methods import METHODS

__all__ = ["run", "main"]

# The rows: a method of pacmpi.methods and how it runs -- "zero" (DDP with
# ZeroRedundancyOptimizer: the dense method's baseline), "replicated" (the DDP hook) or
# "sharded" (ShardedOptimizer).
RUNS = (("dense", "zero"), ("pactrain", "replicated"), ("pactrain", "sharded"),
        ("pactrain-ternary", "replicated"), ("pactrain-ternary", "sharded"))
COLUMNS = [("method", "method", "<16"), ("state elems", "state_elements", ",d"),
           ("state bytes", "state_bytes", ",d"), ("kept bytes", "kept_bytes", ",d"),
           ("all-reduce", "allreduce_bytes", ",d"), ("reduce-scatter", "reduce_scatter_bytes",
                                                    ",d"),
           ("all-gather", "allgather_bytes", ",d"), ("broadcast", "broadcast_bytes", ",d"),
           ("wire/rank", "wire_bytes", ",d"), ("max |w - replicated|", "max_diff", ".2e")]


def _masks(model, density, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.rand(p.shape, generator=gen) < density
            for name, p in model.named_parameters() if p.dim() > 1}


def _state_elements(optimizer):
    return sum(v.numel() for state in optimizer.state.values() for v in state.values()
               if torch.is_tensor(v) and v.dim() > 0)


def label(method, how):
    """A row's name: ``"ddp+zero"``, the method's name, or with "-sharded" after its
    "pactrain" (``"pactrain-sharded-ternary"``)."""
    if how == "zero":
        return "ddp+zero"
    return method.replace("pactrain", "pactrain-sharded", 1) if how == "sharded" else method


def _train(method, how, model_name, density, steps, batch, lr=1e-3):
    """One run of ``method`` (a name of :data:`pacmpi.methods.METHODS`) ``how`` (see
    :data:`RUNS`): ``(model, row)``; the row counts this rank."""
    torch.manual_seed(0)  # the same weights and masks on every rank
    model = build_model(model_name)
    masks = _masks(model, density)
    with torch.no_grad():
        for name, keep in masks.items():
            model.get_parameter(name).mul_(keep)
    size, rank = dist.get_world_size(), dist.get_rank()
    dense = sum(p.numel() * p.element_size() for p in model.parameters())
    row = dict.fromkeys(["allreduce_bytes", "reduce_scatter_bytes", "allgather_bytes",
                         "broadcast_bytes", "kept_bytes"], 0)
    quantize, sharded = METHODS[method].quantize, how == "sharded"
    # Sharded ternary steps after backward (sharded_hook is lossless): no DDP.
    ddp, state = model if sharded and quantize else DDP(model), None
    if sharded:
        optimizer = ShardedOptimizer(model, torch.optim.Adam, masks=masks, lr=lr,
                                     collectives=TorchDistCollectives(), quantize=quantize)
        if not quantize:
            ddp.register_comm_hook(optimizer, sharded_hook)
    elif how == "replicated":
        state = PacTrainHookState(ddp, masks, quantize=quantize)
        ddp.register_comm_hook(state, pactrain_hook)
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    else:
        optimizer = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=lr)
    stats = (lambda: optimizer.reducer.stats) if sharded else (lambda: state.stats)
    gen, sent = torch.Generator().manual_seed(1 + rank), []
    for _ in range(steps):
        optimizer.zero_grad()
        x, y = torch.randn(batch, 3, 32, 32, generator=gen), torch.randint(0, 10, (batch,),
                                                                          generator=gen)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        optimizer.step()
        sent.append(stats()["bytes_sent"] if how != "zero" else 0)
    last = sent[-1] - sent[-2]  # a steady step (the replicated hook's first one is dense)
    if sharded:
        layout, reducer = optimizer.reducer.layout, optimizer.reducer
        itemsize = optimizer.shard.element_size()
        row["reduce_scatter_bytes"] = last
        row["allgather_bytes"] = max(layout.counts) * size * itemsize  # padded to the largest
        row["kept_bytes"] = sum(reducer.memory_report().values())
        row["state_elements"] = _state_elements(optimizer.optimizer)
        row["wire_bytes"] = (size - 1) * (row["reduce_scatter_bytes"]
                                          + row["allgather_bytes"]) // size
    elif how == "replicated":
        row["allreduce_bytes"] = last
        row["kept_bytes"] = sum(state.engine.memory_report().values())
        row["state_elements"] = _state_elements(optimizer)
        row["wire_bytes"] = 2 * (size - 1) * row["allreduce_bytes"] // size
    else:
        row["allreduce_bytes"] = row["broadcast_bytes"] = dense
        row["kept_bytes"] = None  # ZeRO's own buffers: not counted here
        row["state_elements"] = _state_elements(optimizer.optim)
        row["wire_bytes"] = 3 * (size - 1) * dense // size
    row["state_bytes"] = row["state_elements"] * 4
    return model, row


def run(model_name="cifar_cnn", density=0.1, steps=3, batch=8):
    """Rows (the largest of each column over ranks) of every method, on this process group."""
    rows, weights = [], {}
    for method, how in RUNS:
        model, row = _train(method, how, model_name, density, steps, batch)
        name = label(method, how)
        weights[name] = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, row)
        rows.append(dict({k: None if row[k] is None else max(r[k] for r in everyone)
                          for k in row}, method=name))
    for row, (method, _) in zip(rows, RUNS):
        replicated = "pactrain-ternary" if METHODS[method].quantize else "pactrain"
        row["max_diff"] = float((weights[row["method"]] - weights[replicated]).abs().max())
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m pacmpi.experiments.bench_sharded",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cifar_cnn")
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=3, help="at least 2; the last is counted")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--json", default=None, help="write the report here (rank 0)")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = run(args.model, args.density, args.steps, args.batch)
    if dist.get_rank() == 0:
        print(f"{args.model}, weights pruned to density {args.density}, Adam, "
              f"{dist.get_world_size()} ranks, per rank and step (largest over ranks)")
        print(harness.format_table(rows, COLUMNS))
        if args.json:
            harness.write_report(args.json, {"rows": rows, "ranks": dist.get_world_size(),
                                              "model": args.model, "density": args.density},
                                 "pacmpi bench sharded")
    dist.barrier()
    return 0


if __name__ == "__main__":
    from pacmpi.experiments.train import exit_after_gloo  # gloo may abort a finished rank

    exit_after_gloo(main())
