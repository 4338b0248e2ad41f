"""``python -m pacmpi.experiments.bench_sharded`` on 2 ranks under torchrun, 2 steps: its rows
hold what sharding promises. Sharded PacTrain's optimizer state is 1/N of the replicated
one's survivors (each Adam moment once per survivor over all ranks), its bytes on the wire are
replicated PacTrain's but for the all-gather's padding, and its weights equal replicated
PacTrain's bit for bit (a 2-rank sum is one addition, the same in both); with ternary codes,
the reduce-scatter carries replicated ternary's words and the all-gather full values."""
import json
import os
import sys
from pathlib import Path

from pacmpi.experiments.models import build_model
from pacmpi.ternary import TernaryCodec

from mpi_util import run_bounded


def test_sharded_bench_rows(tmp_path):
    report = tmp_path / "sharded.json"
    torchrun = str(Path(sys.executable).parent / "torchrun")
    done = run_bounded([torchrun, "--standalone", "--nproc-per-node", "2", "-m",
                        "pacmpi.experiments.bench_sharded", "--steps", "2", "--batch", "2",
                        "--json", str(report)], timeout=150,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), what="bench_sharded")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "pactrain-sharded" in done.stdout, done.stdout
    rows = {row["method"]: row for row in json.loads(report.read_text())["rows"]}
    zero, replicated, sharded = rows["ddp+zero"], rows["pactrain"], rows["pactrain-sharded"]
    survivors = replicated["allreduce_bytes"] // 4
    assert sharded["reduce_scatter_bytes"] == replicated["allreduce_bytes"]
    assert sharded["state_elements"] == 2 * -(-survivors // 2)  # two moments of the shard
    assert replicated["state_elements"] == 2 * zero["allreduce_bytes"] // 4  # every weight
    assert replicated["wire_bytes"] <= sharded["wire_bytes"] <= replicated["wire_bytes"] + 4
    assert sharded["max_diff"] == 0.0 and replicated["max_diff"] == 0.0
    assert zero["max_diff"] > 0  # the control: dense training moves the pruned weights too
    # Ternary: the reduce-scatter carries the codes replicated ternary all-reduces (whose
    # count adds its scales' all-reduce), under 4 bits a value; the all-gather full values;
    # shards of balanced words differ from the lossless ones by at most the words' padding.
    ternary, codes = rows["pactrain-sharded-ternary"], rows["pactrain-ternary"]
    assert 0 < ternary["reduce_scatter_bytes"] <= codes["allreduce_bytes"]
    assert ternary["reduce_scatter_bytes"] * 8 < sharded["reduce_scatter_bytes"]
    digits = TernaryCodec(2, "int64").digits_per_word  # at most a word's padding per tensor
    tensors = len(list(build_model("cifar_cnn").parameters()))
    assert abs(ternary["state_elements"] - sharded["state_elements"]) < 2 * digits * tensors
    assert ternary["wire_bytes"] > codes["wire_bytes"]  # full values one way
