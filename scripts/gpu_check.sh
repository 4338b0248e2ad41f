#!/usr/bin/env bash
# GPU readiness in one command (< 9 minutes on one H100/H200): the CUDA kernels compiled by nvcc
# and the CuPy parametrization of the tests (bfloat16 included), the fused kernels' throughput
# against the device's memory bandwidth (float32 and bfloat16), `pacmpi bench hook --device
# cuda` (pacmpi's device memory above plain DDP's, step time at 40 and 400 tensors; 1 rank,
# NCCL), the DDP hook (bfloat16 and float32 models) against DDP's all-reduce over NCCL on 1 rank
# and on 2 ranks (NCCL wants a GPU per rank: with one GPU the 2-rank run is gloo on CUDA
# tensors), and `pacmpi bench allreduce --device cuda` on 1 and 2 ranks, CUDA-aware where MPI
# is and host-staged. Ends with one summary table (scripts/gpu_summary.py); JSON and logs under
# OUT_DIR.
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
budget=${PACMPI_GPU_CHECK_SECONDS:-480}  # for the steps: 9 minutes less start-up and the summary
started=$SECONDS
: >"$out/steps.tsv"
step() {  # step NAME SECONDS COMMAND...: bounded, logged, recorded; skipped past the budget
  local name=$1 limit=$2 begin=$SECONDS rc=0; shift 2
  local left=$((budget - (SECONDS - started)))
  echo "== $name"
  if [ "$left" -le 10 ]; then
    printf '%s\tskipped\t0\n' "$name" >>"$out/steps.tsv"; echo "   skipped: budget spent"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  timeout "$limit" "$@" >"$out/$name.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$([ $rc = 0 ] && echo ok || echo "failed($rc)")" \
    "$((SECONDS - begin))" >>"$out/steps.tsv"
  [ $rc = 0 ] || { echo "   FAILED (see $out/$name.log)"; status=1; }
  tail -n 15 "$out/$name.log"
}

"$py" -c "import cupy; print('CuPy', cupy.__version__, 'on', cupy.cuda.runtime.getDeviceProperties(0)['name'].decode())" \
  || { echo "CuPy cannot see a GPU: nothing to check"; exit 2; }
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())")
cd "$here"
status=0
step tests 150 "$py" -m pytest -q -p no:cacheprovider -k "cupy or cuda_compile" tests/test_kernels.py \
  tests/test_cuda_compile.py tests/test_reducer_local.py tests/test_hashing_ternary.py
for dtype in float32 bfloat16; do
  step "codec_$dtype" 45 "$py" -m pacmpi.bench.codec --device cuda --dtype "$dtype" --size 64M \
    --densities 1.0,0.5 --repeat 10 --no-reference --json "$out/codec_$dtype.json"
done
# 8 x Linear(2048): 33.6 M parameters, as issue 23's CPU case (the masks are drawn on the host:
# at width 4096 that alone outlasted 90 s).
step hook_cuda 150 "$py" -m torch.distributed.run --standalone --nproc-per-node 1 \
  -m pacmpi.cli bench hook --device cuda --layers 8 --width 2048 --tensors 40,400 \
  --json "$out/hook_cuda.json"
# The bf16 DDP hook (a bf16/float32 model) against DDP's default all-reduce on CUDA tensors:
# NCCL with a GPU per rank, else gloo (which takes CUDA tensors) for the 2-rank run.
for n in 1 2; do
  backend=nccl
  [ "$n" -gt "$gpus" ] && backend=gloo
  step "ddp_bf16_${n}r_${backend}" 75 env PACMPI_TEST_DEVICE=cuda PACMPI_TEST_BACKEND="$backend" \
    PACMPI_TEST_RANKS="$n" "$py" -m pytest -q -p no:cacheprovider tests/test_bf16.py -k device
done
# auto: device buffers straight to MPI where the library is CUDA-aware (cuda_aware=True is
# refused where it says it is not); no: host staging.
for aware in auto no; do
  for n in 1 2; do
    step "allreduce_${n}r_aware_${aware}" 45 "$mpirun" "${root_flags[@]}" --oversubscribe -n "$n" \
      "$py" -m pacmpi.cli bench allreduce --device cuda --cuda-aware "$aware" \
      --sizes 64M,256M --densities 1.0,0.5,0.2 --iters 3 --warmup 1 \
      --json "$out/allreduce_${n}r_aware_${aware}.json"
  done
done
"$py" scripts/gpu_summary.py "$out"
exit $status
