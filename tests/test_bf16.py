"""bfloat16 gradients and mixed precision through the DDP hook under torchrun (gloo), on 2 and
4 ranks.

Each scenario of tests/mpi_scripts/bf16_scenarios.py and amp_scenarios.py is reported on its
own; one launch per module and rank count runs them. bf16: the hooked mixed-dtype model equals
DDP's default all-reduce of masked gradients (bit for bit at 2 ranks; at 4, both are the ranks'
values added in some order, since gloo's order follows a coordinate's place in the payload);
the order dependence itself and the reference's negative controls; ternary codes from bf16 in
float32 with float32 residuals. AMP: bf16 autocast and fp16 autocast with GradScaler train, and
an Inf on one rank makes every rank skip that optimizer step (lossless and ternary).
"""
import os

import pytest

from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_cases, shared_launches

pytest.importorskip("torch.distributed")
pytest.importorskip("ml_dtypes")

TIMEOUT = 150  # generous: ranks share 2 cores; a hang still fails
MODULES = ("bf16_scenarios.py", "amp_scenarios.py")


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("module, ranks, scenario", [
    case for module in MODULES for case in scenario_cases(module, {
        (module, *key): only for key, only in shared_launches(module, "torchrun").items()})])
def test_bf16_scenario(module, ranks, scenario):
    run_scenarios(module, ranks, "torchrun").check(scenario)


@pytest.mark.skipif("PACMPI_TEST_DEVICE" not in os.environ,
                    reason="scripts/gpu_check.sh sets PACMPI_TEST_DEVICE=cuda on a GPU")
def test_bf16_hook_on_device():
    """The hooked bf16 model against DDP's default all-reduce on CUDA tensors, on
    ``PACMPI_TEST_RANKS`` ranks over ``PACMPI_TEST_BACKEND`` (both passed to the ranks)."""
    ranks = int(os.environ.get("PACMPI_TEST_RANKS", "2"))
    run_scenarios("bf16_scenarios.py", ranks, "torchrun", only=("test_match",),
                  timeout=2 * TIMEOUT).check("test_match")
