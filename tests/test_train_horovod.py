"""``pacmpi train --backend horovod``: every collective of the job on one transport, so it runs
under ``horovodrun --gloo`` (no MPI world) and under ``mpirun``, and matches ``--backend mpi``.

The scenarios (``mpi_scripts/train_hvd_scenarios.py``, one launch per launcher, each reported
on its own) check identical weights on every rank and zero pruned weights, and save the final
weights; here the launches are bounded and the saved weights of the backends compared.
"""
import copy
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

from mpi_util import run_scenarios, scenario_cases  # tests/ is put on sys.path by conftest.py

HOROVODRUN = Path(sys.executable).parent / "horovodrun"
MODULE = "train_hvd_scenarios.py"
TIMEOUT = 150
# horovodrun first: its launch writes the pretrained model the mpirun launch then reads.
LAUNCHES = {
    ("horovodrun",): ("test_horovod_pactrain", "test_horovod_pactrain_ternary",
                      "test_horovod_fp16", "test_cli"),
    ("mpirun",): ("test_horovod_pactrain", "test_horovod_dense", "test_mpi_pactrain",
                  "test_cli"),
}


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory):
    """``(pretrained model path, {launcher: output folder})``, shared by the launches."""
    pretrained = tmp_path_factory.mktemp("pretrained") / "pre.pt"  # by the first launch
    return pretrained, {launcher: tmp_path_factory.mktemp(launcher) for launcher, in LAUNCHES}


def launch(workdirs, launcher):
    """The (one, cached) launch of ``launcher`` on 2 ranks; skips without horovodrun."""
    if launcher == "horovodrun" and not HOROVODRUN.exists():
        pytest.skip("horovodrun not installed")
    pretrained, out = workdirs
    return run_scenarios(MODULE, 2, launcher, only=LAUNCHES[launcher,], timeout=TIMEOUT,
                         env=(("PACMPI_TEST_WORKDIR", str(out[launcher])),
                              ("PACMPI_TEST_PRETRAINED", str(pretrained))))


@pytest.mark.mpi
@pytest.mark.timeout(TIMEOUT + 50)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("launcher, scenario", scenario_cases(MODULE, LAUNCHES))
def test_train_horovod_backend(workdirs, launcher, scenario):
    """Under horovodrun --gloo (no MPI world) and under mpirun."""
    launch(workdirs, launcher).check(scenario)


@pytest.mark.mpi
@pytest.mark.timeout(2 * TIMEOUT + 100)
def test_horovod_pactrain_matches_mpi_backend(workdirs):
    """Same seed, data shards and pruned model; PacTrain is lossless and, on 2 ranks, a sum of
    two values (and Horovod's average of it) is exact in any order, so the weights agree to
    rounding (in practice bit for bit)."""
    for launcher, in LAUNCHES:
        launch(workdirs, launcher)  # both launches ran (cached), whatever their outcomes
    gloo, mpirun = workdirs[1]["horovodrun"], workdirs[1]["mpirun"]
    needed = [mpirun / "mpi-pactrain.pt", gloo / "horovod-pactrain.pt",
              mpirun / "horovod-pactrain.pt", mpirun / "horovod-dense.pt",
              gloo / "horovod-pactrain-ternary.pt"]
    missing = [str(path) for path in needed if not path.exists()]
    assert not missing, f"not saved (see test_train_horovod_backend): {missing}"
    reference = torch.load(mpirun / "mpi-pactrain.pt")
    for path in needed[1:4]:
        weights = torch.load(path)
        assert weights.keys() == reference.keys()
        for name, tensor in reference.items():
            torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    # Negative control: ternary quantization is lossy, so its weights must differ.
    ternary = torch.load(gloo / "horovod-pactrain-ternary.pt")
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
    cfg = train.check_config({})
    data = train._load_data(cfg)
    # Rank 0 of 2 scores every other sample; equal counts on both ranks give its own accuracy.
    assert train._evaluate(cfg, model, data, Doubling([None])) == {
        "test_accuracy": _accuracy(model, data, 0, 2)}
    assert train._evaluate(cfg, model, data) == {"test_accuracy": _accuracy(model, data, 0, 1)}


def _layout(model):
    return [(name, tuple(p.shape)) for name, p in named_prunable_parameters(model).items()]


@torch.no_grad()
def _accuracy(model, data, rank, size):
    model.eval()
    x, y = data.x_test[rank::size], data.y_test[rank::size]
    correct = int((model(x).argmax(1) == y).sum())
    model.train()
    return correct / len(y)

