"""``pacmpi bench allreduce`` at small sizes, every method but PowerSGD (which needs a model's
tensors); then the peers on a few tensors of a model's kinds, through the benchmark's own row
function, with the shapes, buckets and knobs they ran: a scenario every rank runs
(tests/test_cli_bench.py, in the shared launches of tests/mpi_util.py), writing the reports
to $PACMPI_TEST_WORKDIR/bench_allreduce_sizes_<ranks>.json and bench_allreduce_tensors_<ranks>.json
for the outer test."""
import json
import os

import numpy as np

from pacmpi.bench.allreduce import BENCH_METHODS, _bench_one
from pacmpi.buckets import BucketLayout
from pacmpi.cli import main
from pacmpi.collectives import default_collectives
from pacmpi.costmodel import PEER_DEFAULTS

# What PowerSGD tells apart: a conv kernel and matrices it compresses, a matrix it would not
# shrink, vectors. In 128 KiB buckets: a mixed one, two of a matrix alone (nothing to send
# whole) and one of no matrix (no factors), each still three all-reduces.
SHAPES = [(64, 32, 3, 3), (10,), (96, 300), (40, 1000), (8, 8), (256,)]
BUCKET_BYTES = 128 << 10
KNOBS = dict(PEER_DEFAULTS, dgc_ratio=0.01)


def test_small_sizes_and_a_models_tensors(capsys):
    collectives = default_collectives()
    out = os.path.join(os.environ["PACMPI_TEST_WORKDIR"], "bench_allreduce_{}_{}.json")
    status = main(["bench", "allreduce", "--sizes", "64K,1M", "--densities", "1.0,0.2",
                   "--methods", ",".join(m for m in BENCH_METHODS if m != "powersgd"),
                   "--iters", "2", "--warmup", "1",
                   "--json", out.format("sizes", collectives.size)])
    printed = capsys.readouterr().out
    layout = BucketLayout(SHAPES, [np.float32] * len(SHAPES), BUCKET_BYTES)
    mask = np.ones(sum(int(np.prod(s)) for s in SHAPES), dtype=bool)
    # Three calls: the last, which the validation replays, starts PowerSGD from warm Qs.
    rows = [_bench_one(collectives, method, layout, mask, 1.0, 2, 1, 0, np, KNOBS)
            for method in ("topk", "dgc", "terngrad", "powersgd")]
    if collectives.rank == 0:
        with open(out.format("tensors", collectives.size), "w") as fh:
            json.dump({"shapes": SHAPES, "buckets": len(layout.buckets), "knobs": KNOBS,
                       "rows": rows}, fh)
        assert "busbw" in printed and "#wrong" in printed, printed  # rank 0 prints the table
    assert status == 0 and not any(r["wrong"] for r in rows), (status, rows)
