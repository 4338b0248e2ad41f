"""``pacmpi train --outer-period 4`` (DiLoCo-style outer steps) on the digits CNN: every rank runs
these tests in this order under mpirun (tests/test_outer_train.py), each reported on its own.

1. dense fp32 outer steps (outer learning rate 1, no momentum: plain model averaging): bytes on
   every 4th step only, the whole model each time;
2. PacTrain (lossless survivors, DiLoCo's outer optimizer): the same steps, fewer bytes;
3. over torch.distributed (``--backend ddp``, gloo over the same ranks): torch's
   PostLocalSGDOptimizer averages the weights as 1's outer steps do, the same weights up to
   rounding (the oracle) and not 2's (the control); 2 over gloo ends bit for bit where it did
   over MPI (2 ranks: every sum is one addition, exact in any order);
4. ternary codes of the unpruned model over 6 steps: the last, shorter period closes the run,
   and evaluations between outer steps score the last outer step's model;
5. 2 again with a checkpoint at step 6 (mid-period) ends where 2 did, and a run resumed from
   that checkpoint ends there too, bit for bit, with the same bytes on steps 7 and 8.

Every run ends with the same weights on every rank. Files (the pretrained model) are in
$PACMPI_TEST_WORKDIR.
"""
import os
import socket

import torch
import torch.distributed as dist
from mpi4py import MPI

from pacmpi.experiments.train import fine_tune

comm = MPI.COMM_WORLD
WORKDIR = os.environ["PACMPI_TEST_WORKDIR"]
H = 4
BASE = {"width": 8, "hidden": "64", "pretrained": os.path.join(WORKDIR, "p.pt"),
        "pretrain_epochs": 1, "epochs": 1, "max_steps": 8, "progress": False, "ratio": 0.5,
        "threads": 1, "outer_period": H}
RUNS = {}  # name -> (model, result), filled by the tests


def train(name, **config):
    """One run of the job on every rank; checks that every rank ends with the same weights."""
    model, result = fine_tune(dict(BASE, **config))
    digests = comm.allgather(result["state_sha256"])
    assert len(set(digests)) == 1, f"{name}: the ranks ended with different weights"
    RUNS[name] = model, result
    return result


def synced_steps(result):
    """The steps (1-based) that sent bytes, and the bytes of the first of them."""
    sent = [s["bytes_sent"] for s in result["steps"]]
    synced = [i + 1 for i, b in enumerate(sent) if b]
    return synced, sent[synced[0] - 1] if synced else 0


def weights(name):
    return torch.cat([p.detach().reshape(-1) for p in RUNS[name][0].parameters()])


def test_dense_outer_steps_send_the_model_every_h_steps_only():
    result = train("dense", method="dense", outer_lr=1.0, outer_momentum=0.0)
    synced, sent = synced_steps(result)
    assert synced == [4, 8] and result["outer_steps"] == 2, (synced, result["outer_steps"])
    assert sent == result["steps"][0]["dense_bytes"]  # every weight, fp32
    assert result["summary"]["bytes_per_step"] == 2 * sent / 8
    # A global copy of the weights; no outer momentum at momentum 0.
    memory = result["outer_memory"]
    assert memory["global"] == sent and memory["outer_optimizer"] == 0, memory


def test_pactrain_outer_steps_send_fewer_bytes():
    result = train("pactrain", method="pactrain")
    synced, sent = synced_steps(result)
    assert synced == [4, 8] and result["fallbacks"] == 0, (synced, result["fallbacks"])
    dense = synced_steps(RUNS["dense"][1])[1]
    assert 0 < sent < 0.6 * dense, (sent, dense)  # half the weights pruned (plus the dense rest)
    memory = result["outer_memory"]  # DiLoCo's Nesterov momentum: a second copy
    assert memory["global"] == memory["outer_optimizer"] == dense and memory["reducer"] > 0, memory


def test_over_torch_distributed_postlocal_sgd_averages_as_an_outer_step_of_rate_1():
    if not dist.is_initialized():  # gloo over the same ranks, on a port rank 0 found free
        port = None
        if comm.rank == 0:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{comm.bcast(port)}",
                                rank=comm.rank, world_size=comm.size)
    try:
        result = train("postlocal", method="dense", backend="ddp", outer_optimizer="postlocal")
        gloo = train("pactrain over gloo", method="pactrain", backend="ddp")
    finally:
        dist.barrier()
        dist.destroy_process_group()
    assert synced_steps(result) == synced_steps(RUNS["dense"][1])
    # Rounding apart (the mean of the weights against global - mean(global - local)).
    assert torch.allclose(weights("postlocal"), weights("dense"), rtol=1e-4, atol=1e-6)
    assert not torch.allclose(weights("postlocal"), weights("pactrain"), rtol=1e-2, atol=1e-4)
    assert gloo["state_sha256"] == RUNS["pactrain"][1]["state_sha256"]
    assert synced_steps(gloo) == synced_steps(RUNS["pactrain"][1])


def test_ternary_closes_a_shorter_last_period_and_evaluates_global_weights():
    result = train("ternary", method="pactrain-ternary", ratio=0.0, max_steps=6, eval_every=1)
    synced, sent = synced_steps(result)
    assert synced == [4, 6] and result["outer_steps"] == 2, synced
    assert 0 < sent < synced_steps(RUNS["dense"][1])[1] / 8  # 2-bit codes of every weight
    accuracy = {r["step"]: r["test_accuracy"] for r in result["epochs"]}
    # Steps 1-3 score the model the run started from, 5 the one step 4's outer step left.
    assert accuracy[1] == accuracy[2] == accuracy[3] and accuracy[5] == accuracy[4], accuracy


def test_a_checkpoint_mid_period_resumes_bit_for_bit():
    path = os.path.join(WORKDIR, "outer.ckpt")  # one file, written by rank 0
    whole = train("checkpointed", method="pactrain", checkpoint=path, checkpoint_every=6)
    assert whole["state_sha256"] == RUNS["pactrain"][1]["state_sha256"]  # saving changes nothing
    resumed = train("resumed", method="pactrain", checkpoint=path, resume=True)
    assert resumed["state_sha256"] == whole["state_sha256"]
    assert [s["bytes_sent"] for s in resumed["steps"]] == [s["bytes_sent"] for s in whole["steps"]]
    assert resumed["outer_steps"] == whole["outer_steps"] == 2
