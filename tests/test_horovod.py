"""PacTrainCompressor and HorovodCollectives on 2 Horovod ranks, under both controllers, and on
4 ranks.

Each scenario of tests/mpi_scripts/hvd_compressor.py is reported on its own; one launch per
controller and rank count runs them (a launch costs seconds; mpirun's is shared with other
Horovod modules): ``horovodrun --gloo`` (Gloo
controller) and plain ``mpirun`` (``hvd.init()`` picks the MPI controller). A hang fails what
the launch had not reported at its timeout.

match: packed training equals Horovod's dense training on masked grads (Average and Sum), also
through a bare hvd.allreduce, and a stray tensor fails on every rank; gradual: a mask change
mid-run falls back to dense, then packs again, still exact; ternary: op=hvd.Sum decodes to
exactly scale * (integer sum of codes), op=hvd.Average is refused; reducer: PacTrainReducer over
HorovodCollectives sums exactly; checkpoint: state_dict / load_state_dict (and pickling with the
model) into a new DistributedOptimizer resumes bit for bit, lossless and ternary, residuals are
dropped with a warning at another world size, and a checkpoint of another quantize mode, other
parameters or other masks (on one rank) fails on every rank; prune: torch.nn.utils.prune's
logical mask names pack and equal the dense run, bad keys fail on every rank; interrupt:
backward raising mid-step, then reset_step() or the automatic reset, retries the step
bit-identically to an uninterrupted run; mismatch: the last rank moves its survivors at step 2
(same count): every rank raises MaskMismatchError naming it, before anything is summed. On 4
ranks: base-9 ternary words still decode exactly, the reducer over Horovod sums exactly, a
divergent mask on rank 3 stops all four ranks. bf16: Horovod itself refuses bfloat16; the
compressor's float32-staged bf16 payloads average to the masked local grads rounded once, at 2
and 4 ranks.
"""
import pytest

from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_cases, shared_launches

pytest.importorskip("horovod.torch")

MODULE = "hvd_compressor.py"
TIMEOUT = 180  # generous: ranks share 2 cores; a hang still fails
# mpirun's launches are shared with the sharded optimizer's Horovod scenarios; at 4 ranks, the
# scenarios that need more than 2.
LAUNCHES = {("horovodrun", 2): None, **{("mpirun", *key): only for key, only
                                        in shared_launches(MODULE).items()}}


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("launcher, ranks, scenario", scenario_cases(MODULE, LAUNCHES))
def test_horovod_scenario(launcher, ranks, scenario):
    run_scenarios(MODULE, ranks, launcher, only=LAUNCHES[launcher, ranks],
                  timeout=TIMEOUT).check(scenario)
