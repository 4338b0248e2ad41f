#!/usr/bin/env bash
# GPU readiness in one command (< 8 minutes on one H100/H200): the CuPy parametrization of the
# tests, the fused kernels' throughput, and `pacmpi bench allreduce --device cuda` at 64 MiB-1 GiB
# on 1 and 2 ranks, CUDA-aware and host-staged. Writes JSON (and logs) under OUT_DIR.
#   usage: scripts/gpu_check.sh OUT_DIR [PYTHON]
set -uo pipefail
out=${1:?usage: scripts/gpu_check.sh OUT_DIR [PYTHON]}
py=${2:-python3}
mkdir -p "$out"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bin=$(dirname "$(command -v "$py")")
mpirun=$(command -v mpirun || echo "$bin/mpirun")
root_flags=()
[ "$(id -u)" = 0 ] && root_flags=(--allow-run-as-root)
status=0
step() {  # step NAME SECONDS COMMAND...: bounded, logged, failure recorded but not fatal
  local name=$1 limit=$2; shift 2
  echo "== $name"
  if ! timeout "$limit" "$@" >"$out/$name.log" 2>&1; then
    echo "   FAILED (see $out/$name.log)"; status=1
  fi
  tail -n 25 "$out/$name.log"
}

"$py" -c "import cupy; print('CuPy', cupy.__version__, 'on', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())" \
  || { echo "CuPy cannot see a GPU: nothing to check"; exit 2; }
cd "$here"
step tests 180 "$py" -m pytest -q -p no:cacheprovider -k cupy tests/test_kernels.py \
  tests/test_reducer_local.py tests/test_hashing_ternary.py
step codec 90 "$py" -m pacmpi.bench.codec --device cuda --json "$out/codec_cuda.json"
for aware in yes no; do
  for n in 1 2; do
    step "allreduce_${n}r_aware_${aware}" 120 "$mpirun" "${root_flags[@]}" --oversubscribe -n "$n" \
      "$py" -m pacmpi.cli bench allreduce --device cuda --cuda-aware "$aware" \
      --sizes 64M,256M,1G --densities 1.0,0.5,0.2 --iters 3 --warmup 1 \
      --json "$out/allreduce_${n}r_aware_${aware}.json"
  done
done
exit $status
