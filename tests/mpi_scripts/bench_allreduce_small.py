import sys

from pacmpi.cli import main

sys.exit(main(["bench", "allreduce", "--sizes", "64K,1M", "--densities", "1.0,0.2",
               "--iters", "2", "--warmup", "1", "--json", sys.argv[1]]))
