"""``pacmpi train --backend horovod``: every collective of the job on one transport, so it runs
under ``horovodrun --gloo`` (no MPI world) and under ``mpirun``, and matches ``--backend mpi``.

The worker (``mpi_scripts/train_hvd_job.py``) checks identical weights on every rank and zero
pruned weights; here the launches are bounded and the saved weights of the backends compared.
"""
import copy
import json
import re
import sys
from pathlib import Path

import pytest
import torch

from pacmpi import Collectives
from pacmpi.adapters.pruning import named_prunable_parameters, prune
from pacmpi.adapters.torch_sync import transport
from pacmpi.experiments import train
from pacmpi.experiments.models import DigitsCNN

from mpi_util import run_horovod_gloo, run_mpi  # tests/ is put on sys.path by conftest.py

HOROVODRUN = Path(sys.executable).parent / "horovodrun"
JOB = "train_hvd_job.py"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return tmp_path_factory.mktemp("pretrained") / "pre.pt"  # written by the first launch


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory, pretrained):
    if not HOROVODRUN.exists():
        pytest.skip("horovodrun not installed")
    out = tmp_path_factory.mktemp("gloo")
    result = run_horovod_gloo(JOB, 2, out, pretrained, "horovod:pactrain",
                              "horovod:pactrain-ternary", "horovod:fp16", timeout=150)
    return result.returncode, result.stdout + result.stderr, out


@pytest.fixture(scope="module")
def mpirun_run(tmp_path_factory, pretrained, gloo_run):  # after gloo_run: the cache exists
    out = tmp_path_factory.mktemp("mpirun")
    result = run_mpi(JOB, 2, out, pretrained, "horovod:pactrain", "horovod:dense",
                     "mpi:pactrain", timeout=150)
    return result.returncode, result.stdout + result.stderr, out


def assert_ok(code, output, entries):
    assert code == 0, output
    for entry in entries:
        assert f"OK {entry}" in output, output
    assert output.count("pacmpi train:") == 1, output  # the CLI summary, on rank 0 only


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_horovodrun_gloo_without_mpi_world(gloo_run):
    code, output, out = gloo_run
    assert_ok(code, output, ["horovod pactrain", "horovod pactrain-ternary", "horovod fp16"])
    written = json.loads((out / "cli.json").read_text())
    assert written["world_size"] == 2 and written["config"]["backend"] == "horovod"
    assert len(written["steps"]) == 4


@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_mpirun_horovod_backend(mpirun_run):
    assert_ok(*mpirun_run[:2], ["horovod pactrain", "horovod dense", "mpi pactrain"])


@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_horovod_pactrain_matches_mpi_backend(gloo_run, mpirun_run):
    """Same seed, data shards and pruned model; PacTrain is lossless and, on 2 ranks, a sum of
    two values (and Horovod's average of it) is exact in any order, so the weights agree to
    rounding (in practice bit for bit)."""
    reference = torch.load(mpirun_run[2] / "mpi-pactrain.pt")
    for path in (gloo_run[2] / "horovod-pactrain.pt", mpirun_run[2] / "horovod-pactrain.pt",
                 mpirun_run[2] / "horovod-dense.pt"):
        weights = torch.load(path)
        assert weights.keys() == reference.keys()
        for name, tensor in reference.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # Negative control: ternary quantization is lossy, so its weights must differ.
    ternary = torch.load(gloo_run[2] / "horovod-pactrain-ternary.pt")
    assert any(not torch.allclose(ternary[k].float(), reference[k].float()) for k in reference)


# ---------------------------------------------------------------------------------- local
@pytest.mark.parametrize("config, message", [
    ({"backend": "horovod", "method": "topk"},
     re.escape("run --method topk|terngrad|dgc with --backend mpi")),
    ({"backend": "horovod", "checkpoint": "run.ckpt"}, "does not support --checkpoint"),
])
def test_horovod_backend_refuses_topk_and_checkpoints(config, message):
    # Refused while validating the configuration, before any collective: every rank alike.
    with pytest.raises(ValueError, match=message):
        train.run(config)


class _FakeRanks(Collectives):
    """Rank 0 of ``size`` ranks whose all-gathers return ``others`` for the remote ranks."""

    def __init__(self, others=()):
        self.rank, self.size, self._others = 0, 1 + len(others), list(others)

    def allreduce(self, buf, op="sum"):
        pass

    def bcast(self, buf, root=0):
        pass

    def allgather_object(self, obj):
        return [obj] + self._others


def test_transport_accepts_either_kind():
    fake = _FakeRanks()
    assert transport(collectives=fake) is fake and transport(comm=fake) is fake
    with pytest.raises(ValueError, match="not both"):
        transport(comm=object(), collectives=fake)


def test_prune_over_collectives_decides_like_local_pruning():
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    shared = prune(copy.deepcopy(model), 0.5, collectives=_FakeRanks())
    local = prune(model, 0.5)
    assert shared.keys() == local.keys()
    assert all(torch.equal(shared[k], local[k]) for k in local)


def test_prune_over_collectives_rejects_a_rank_with_another_model():
    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    other_layout = [("conv1.weight", (1, 1, 1, 1))]
    with pytest.raises(ValueError, match=r"ranks \[1\] differ from rank 0"):
        prune(model, 0.5, collectives=_FakeRanks([(other_layout, None)]))
    # Negative control: a rank reporting the same layout is accepted.
    same = prune(copy.deepcopy(model), 0.5, collectives=_FakeRanks([(_layout(model), None)]))
    assert same


def test_evaluate_sums_counts_over_the_transport():
    class Doubling(_FakeRanks):
        def allreduce(self, buf, op="sum"):
            buf *= 2  # two ranks with the same counts

    torch.manual_seed(0)
    model = DigitsCNN(width=8)
    data = train._load_data(train._config({}))
    # Rank 0 of 2 scores every other sample; equal counts on both ranks give its own accuracy.
    assert train._evaluate(model, data, Doubling([None])) == _accuracy(model, data, 0, 2)
    assert train._evaluate(model, data) == _accuracy(model, data, 0, 1)


def _layout(model):
    return [(name, tuple(p.shape)) for name, p in named_prunable_parameters(model).items()]


@torch.no_grad()
def _accuracy(model, data, rank, size):
    model.eval()
    x, y = data.x_test[rank::size], data.y_test[rank::size]
    correct = int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(y)

