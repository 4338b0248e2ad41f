"""PacTrainCompressor under Horovod's elastic mode (``horovodrun --gloo`` with a host discovery
script, tests/mpi_scripts/hvd_elastic_train.py): a worker is SIGKILLed, the other rolls back to
the last commit and trains alone, then a fresh worker joins when the host's blacklist cooldown
ends, and both finish.

Two one-slot "hosts" (``localhost`` and ``127.0.0.1``, both this machine) so that Horovod
blacklists only the killed worker's. Per mode (lossless, ternary): the run ends with code 0, the
state saw the worlds 2, 1, 2, both final workers report the same step, and their in-worker
checks ran (lossless: every step's reduced gradient equals the dense sum of masked gradients;
ternary: the residual rule at the shrink and at the growth; both: the compressor's step follows
the state's after every rollback, pruned weights 0, ranks identical). Negative control: the same
ternary run without ``compression=`` in ``TorchState`` fails (the compressor is not rolled back).

snippet: docs/trainers/elastic.md's Horovod script, unchanged, under the same launcher (no
cooldown) with rank 1 killed after its first commit: the survivor finishes alone.
"""
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from doc_snippets import snippet
from mpi_util import MPI_SCRIPTS, run_bounded

pytest.importorskip("horovod.torch")

KILL_AT, TIMEOUT = 5, 150  # ranks share 2 cores; a hang still fails


def horovodrun(workdir, *command, cooldown=True):
    """Run ``command`` elastic on two one-slot hosts, in ``workdir``, bounded; afterwards no
    process may still name ``workdir``."""
    discovery = workdir / "hosts.sh"
    discovery.write_text("#!/bin/sh\necho localhost:1\necho 127.0.0.1:1\n")
    discovery.chmod(discovery.stat().st_mode | stat.S_IXUSR)
    tool = Path(sys.executable).parent / "horovodrun"
    argv = [str(tool), "--gloo", "-np", "2", "--min-np", "1", "--max-np", "2",
            "--host-discovery-script", str(discovery), "--network-interface", "lo",
            *(["--blacklist-cooldown-range", "1", "2"] if cooldown else []),
            sys.executable, *map(str, command)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    done = run_bounded(["bash", "-c", 'cd "$0" && exec "$@"', str(workdir), *argv],
                       timeout=TIMEOUT, env=env, what=f"{command[0]} under elastic horovodrun")
    left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _names(pid, workdir)]
    assert not left, f"processes left behind: {left}"
    return done


def train(workdir, mode):
    done = horovodrun(workdir, MPI_SCRIPTS / "hvd_elastic_train.py", workdir, mode, KILL_AT)
    return done, [json.loads(f.read_text()) for f in sorted(workdir.glob("result.*.json"))]


def _names(pid, workdir):
    try:
        return str(workdir).encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


@pytest.mark.parametrize("mode", ["lossless", "ternary"])
def test_worker_lost_then_rejoined(tmp_path, mode):
    done, results = train(tmp_path, mode)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "killed").read_text() == f"rank 1 at step {KILL_AT}"
    assert sorted(r["rank"] for r in results) == [0, 1], results
    for result in results:
        assert result["sizes"] == [2, 1, 2] and result["size"] == 2, result
        assert result["step"] == results[0]["step"] > result["regrown_at"] > KILL_AT, result
        assert result["stats"] == results[0]["stats"], "the compressors' counters differ"
    checks = [r["checks"] for r in sorted(results, key=lambda r: r["rank"])]
    if mode == "lossless":  # the survivor checked every step it ran, the newcomer its own
        assert checks[0]["reference"] >= results[0]["step"] > checks[1]["reference"] > 0
    else:
        assert [c["shrink"] for c in checks] == [1, 0] and all(c["growth"] == 1 for c in checks)
        said = [w for r in results for w in r["warnings"]]
        assert sum("from 2 to 1 ranks (1 of the 2 kept" in w for w in said) == 1, said
        assert sum("from 1 to 2 ranks (1 of the 1 kept" in w for w in said) == 2, said


def test_without_the_state_handler_the_compressor_is_not_rolled_back(tmp_path):
    done, results = train(tmp_path, "unmanaged")
    assert done.returncode != 0 and not results
    assert f"compressor at {KILL_AT}, state {KILL_AT // 3 * 3}" in done.stdout + done.stderr


def test_snippet_survives_a_lost_worker(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(snippet("horovod-elastic"))
    done = horovodrun(tmp_path, MPI_SCRIPTS / "hvd_kill_after_commit.py", script,
                      cooldown=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "killed").read_text() == "rank 1 after the commit at step 4"
    assert "rank 0 of 1: done at step 12" in done.stdout, done.stdout[-3000:]
