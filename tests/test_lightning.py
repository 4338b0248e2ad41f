"""PacTrain in PyTorch Lightning (``pacmpi.adapters.lightning``): ``DDPStrategy`` with the hook
and ``PacTrainCallback`` on 2 CPU ranks (gloo).

Under torchrun, one launch runs every scenario of tests/mpi_scripts/lightning_scenarios.py, each
reported on its own. lossless: a state built before the process group exists trains as DDP's
all-reduce of masked gradients, bit for bit. ternary: lowers the loss, sends under half the
dense bytes. Both: pruned weights exactly 0, ranks bit-identical. without_callback (negative
control): Lightning drops the hook on CPU; without the callback pruned weights revive. resume:
ModelCheckpoint + ``fit(ckpt_path=)`` continues bit for bit (lossless and ternary), the
checkpoint loads with ``weights_only=True``, and one without pacmpi's state resumes to other
weights. resume_at_another_world_size: residuals of 3 old ranks load as their mean, with a
warning; at the same world size each rank keeps its own.

The page's snippet (docs/trainers/lightning.md) runs as ``python train.py``: Lightning's own
launcher starts the second rank. A strategy without DDP is refused, naming it.
"""
import sys

import pytest
import torch

from doc_snippets import snippet
from mpi_util import run_bounded, run_scenarios, scenario_cases

L = pytest.importorskip("lightning")

MODULE = "lightning_scenarios.py"
TIMEOUT = 240  # generous: two ranks share 2 cores with Lightning's start-up; a hang still fails
CHECK = """
assert state.step == trainer.global_step > 0, (state.step, trainer.global_step)
assert state.stats["packed_reductions"] > 0, state.stats
for name, keep in masks.items():
    assert torch.all(model.get_parameter(name)[~keep] == 0), name
print(f"rank {trainer.global_rank}: {state.step} PacTrain steps, pruned weights 0")
"""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("lightning"))


@pytest.mark.timeout(TIMEOUT + 60)  # the first scenario waits for the whole launch
@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, {(2,): None}))
def test_lightning_scenario(workdir, ranks, scenario):
    run_scenarios(MODULE, ranks, "torchrun", timeout=TIMEOUT,
                  env=(("PACMPI_TEST_WORKDIR", workdir),)).check(scenario)


@pytest.mark.timeout(TIMEOUT + 60)
def test_snippet_runs_as_a_python_script(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(snippet("lightning") + CHECK)
    done = run_bounded(["bash", "-c", 'cd "$0" && exec "$@"', str(tmp_path), sys.executable,
                        str(script)], timeout=TIMEOUT, env=None, what="the Lightning snippet")
    assert done.returncode == 0, done.stdout + done.stderr
    for rank in (0, 1):
        assert f"rank {rank}: 8 PacTrain steps, pruned weights 0" in done.stdout, done.stdout


class Tiny(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_callback_refuses_a_strategy_without_ddp(tmp_path):
    """One device: Lightning's SingleDeviceStrategy wraps no DDP, so there is nothing to hook."""
    from pacmpi.adapters.ddp import PacTrainHookState
    from pacmpi.adapters.lightning import PacTrainCallback

    model = Tiny()
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                        callbacks=[PacTrainCallback(PacTrainHookState(model, {}))],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=tmp_path)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 3)))
    with pytest.raises(TypeError, match="needs a DDP strategy .* SingleDeviceStrategy"):
        trainer.fit(model, loader)
