"""The README's front-end snippets run as written, each on 2 ranks: the raw loop, the Horovod
wrapper and the sharded optimizer under mpirun (tests/mpi_scripts/readme_quickstart.py), the
DDP two-liners (PacTrain's hook, the sharded hook) in a torchrun job. The snippets are the
blocks marked ``<!-- snippet: NAME -->`` (doc_snippets.py); the user guide's copies are the
same code (test_docs checks), so they run here too."""
import os
import re
import sys
from pathlib import Path

import pytest

from doc_snippets import README, marked, snippet
from mpi_util import run_bounded, run_mpi

FRONT_ENDS = ["raw-loop", "horovod", "ddp", "sharded", "sharded-ddp", "outer"]


def test_readme_has_one_snippet_per_front_end():
    assert [(name, language) for name, language, _ in marked(README)] == [
        (name, "python") for name in FRONT_ENDS]


@pytest.mark.mpi
@pytest.mark.parametrize("front_end", ["raw-loop", "horovod", "sharded", "outer"])
def test_readme_snippet_runs_on_two_ranks(front_end, tmp_path):
    if front_end == "horovod":
        pytest.importorskip("horovod.torch")
    code = tmp_path / f"{front_end}.py"
    code.write_text(snippet(front_end))
    result = run_mpi("readme_quickstart.py", 2, front_end, code, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(rf"OK readme {front_end} rank \d", result.stdout)) == [
        f"OK readme {front_end} rank {r}" for r in range(2)], result.stdout + result.stderr


def test_readme_ddp_snippet_is_the_two_liner():
    lines = [line for line in snippet("ddp").splitlines() if line.strip()]
    assert lines[0] == "from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook"
    assert len(lines) == 3 and "register_comm_hook(PacTrainHookState(ddp_model, masks)" in lines[2]


# Runs the DDP two-liner (argv[1]) on every rank of a torchrun job, then trains 3 steps (DDP
# rebuilds its buckets after the first) on different data per rank and checks that the hook
# ran: pruned coordinates' gradients exactly 0 (DDP's default all-reduce would average
# nonzero ones), kept ones not, every rank's gradients identical, DDP names the hook.
DDP_SNIPPET_CHECK = """
import os, sys
from pathlib import Path
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)  # the same weights, hence the same magnitude masks, on every rank
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
masks = {name: p.detach().abs() > p.detach().abs().median()
         for name, p in model.named_parameters() if p.dim() > 1}
names = {"torch": torch, "model": model, "masks": masks}
exec(Path(sys.argv[1]).read_text(), names)
ddp_model = names["ddp_model"]
assert ddp_model._get_ddp_logging_data().get("comm_hook") == "pactrain_hook"
optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
torch.manual_seed(1 + rank)  # different data per rank
for step in range(3):
    optimizer.zero_grad()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    torch.nn.functional.cross_entropy(ddp_model(x), y).backward()
    for name, p in model.named_parameters():
        if name in masks:
            assert bool((p.grad[~masks[name]] == 0).all()), (step, name, "pruned grads not 0")
            assert bool((p.grad[masks[name]] != 0).any()), (step, name)
        everyone = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, p.grad)
        assert all(torch.equal(g, p.grad) for g in everyone), (step, name, "ranks differ")
    optimizer.step()
"""

# The sharded DDP snippet: 3 Adam steps (only optimizer.step() after backward, which the hook
# already did) on different data per rank leave every rank's weights identical and updated,
# the pruned ones as they were, and each rank's Adam state its shard of the survivors.
SHARDED_DDP_CHECK = """
import os, sys
from pathlib import Path
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)  # the same weights, hence the same magnitude masks, on every rank
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
masks = {name: p.detach().abs() > p.detach().abs().median()
         for name, p in model.named_parameters() if p.dim() > 1}
before = [p.detach().clone() for p in model.parameters()]
names = {"torch": torch, "model": model, "masks": masks}
exec(Path(sys.argv[1]).read_text(), names)
ddp_model, optimizer = names["ddp_model"], names["optimizer"]
assert ddp_model._get_ddp_logging_data().get("comm_hook") == "sharded_hook"
torch.manual_seed(1 + rank)  # different data per rank
for step in range(3):
    optimizer.zero_grad()
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    torch.nn.functional.cross_entropy(ddp_model(x), y).backward()
    optimizer.step()
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = [torch.empty_like(weights) for _ in range(size)]
dist.all_gather(everyone, weights)
assert all(torch.equal(w, weights) for w in everyone), "ranks differ"
for (name, p), old in zip(model.named_parameters(), before):
    assert not torch.equal(p, old), (name, "never updated")
    if name in masks:
        assert torch.equal(p.detach()[~masks[name]], old[~masks[name]]), (name, "pruned moved")
survivors = sum(int(m.sum()) for m in masks.values()) + 32 + 4
moments = optimizer.optimizer.state[optimizer.shard]["exp_avg"]
assert moments.numel() == optimizer.shard.numel() <= -(-survivors // size), moments.numel()
"""

# The user guide's DDP loop with outer steps (period 4): 8 steps on different data per rank end
# on an outer step, so every rank holds the same weights, pruned ones exactly 0; DDP reduced
# nothing (no comm hook ran, the outer steps sent the bytes).
OUTER_DDP_CHECK = """
import os, sys
from pathlib import Path
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, size = dist.get_rank(), dist.get_world_size()
torch.manual_seed(rank)  # different weights: OuterSync starts every rank from rank 0's
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
masks = {name: torch.rand(p.shape, generator=torch.Generator().manual_seed(3)) < 0.5
         for name, p in model.named_parameters() if p.dim() > 1}
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
batches = [(torch.randn(8, 16), torch.randint(0, 4, (8,))) for _ in range(8)]
names = {"torch": torch, "model": model, "masks": masks, "optimizer": optimizer,
         "batches": batches, "loss_fn": torch.nn.functional.cross_entropy}
exec(Path(sys.argv[1]).read_text(), names)
outer = names["outer"]
assert outer.outer_steps == 2 and outer.stats["packed_reductions"] > 0, outer.stats
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
everyone = [torch.empty_like(weights) for _ in range(size)]
dist.all_gather(everyone, weights)
assert all(torch.equal(w, weights) for w in everyone), "ranks differ"
for name, p in model.named_parameters():
    if name in masks:
        assert bool((p[~masks[name]] == 0).all()), (name, "pruned weights moved")
"""

# Both end alike: torch 2.13's gloo sometimes aborts a process at interpreter exit ("terminate
# called without an active exception", destroy_process_group() or not), more often on a
# loaded host: skip it.
TORCHRUN_CHECKS = {"ddp": DDP_SNIPPET_CHECK, "sharded-ddp": SHARDED_DDP_CHECK,
                   "outer-ddp": OUTER_DDP_CHECK}
EPILOGUE = """
print(f"OK readme rank {rank}", flush=True)
dist.barrier()
os._exit(0)
"""


@pytest.mark.timeout(150)
@pytest.mark.parametrize("front_end", sorted(TORCHRUN_CHECKS))
def test_readme_ddp_snippet_runs_under_torchrun(front_end, tmp_path):
    script, code = tmp_path / "readme_ddp.py", tmp_path / "ddp.py"
    script.write_text(TORCHRUN_CHECKS[front_end] + EPILOGUE)
    code.write_text(snippet(front_end))
    torchrun = str(Path(sys.executable).parent / "torchrun")
    done = run_bounded([torchrun, "--standalone", "--nproc-per-node", "2", str(script),
                        str(code)], timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"),
                       what="the README's DDP snippet under torchrun")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(re.findall(r"OK readme rank \d", done.stdout)) == [
        "OK readme rank 0", "OK readme rank 1"]
