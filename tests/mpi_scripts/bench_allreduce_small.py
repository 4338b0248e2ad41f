import sys

from pacmpi.bench.allreduce import BENCH_METHODS
from pacmpi.cli import main

sys.exit(main(["bench", "allreduce", "--sizes", "64K,1M", "--densities", "1.0,0.2",
               "--methods", ",".join(BENCH_METHODS), "--iters", "2", "--warmup", "1",
               "--json", sys.argv[1]]))
