# pacmpi for GPU clusters: CUDA, CUDA-aware Open MPI 5, mpi4py, CuPy, PyTorch, Horovod 0.28.1
# (built from its sdist with the same C++17 fix as scripts/setup.sh), and pacmpi.
#   docker build -t pacmpi .
#   docker run --gpus all --rm pacmpi mpirun --allow-run-as-root -n 4 pacmpi bench allreduce
# Versions follow scripts/setup.sh; only the CUDA builds differ from the CPU set-up.
FROM nvidia/cuda:12.8.1-cudnn-devel-ubuntu22.04

ARG OPENMPI_VERSION=5.0.6
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/openmpi/bin:/opt/venv/bin:$PATH \
    LD_LIBRARY_PATH=/opt/openmpi/lib:$LD_LIBRARY_PATH \
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev build-essential cmake git wget ca-certificates \
        iproute2 libnuma-dev && \
    rm -rf /var/lib/apt/lists/*

# Open MPI with CUDA support, so pacmpi hands CuPy buffers straight to MPI (cuda_aware="auto").
RUN wget -q https://download.open-mpi.org/release/open-mpi/v5.0/openmpi-${OPENMPI_VERSION}.tar.bz2 && \
    tar xjf openmpi-${OPENMPI_VERSION}.tar.bz2 && cd openmpi-${OPENMPI_VERSION} && \
    ./configure --prefix=/opt/openmpi --with-cuda=/usr/local/cuda --with-cuda-libdir=/usr/local/cuda/lib64/stubs && \
    make -j"$(nproc)" install && cd .. && rm -rf openmpi-${OPENMPI_VERSION}*

RUN python3 -m venv /opt/venv && \
    pip install --no-cache-dir --upgrade pip setuptools wheel && \
    # PyPI's Linux torch wheel is the CUDA build (the CPU set-up takes the local CPU wheel).
    pip install --no-cache-dir torch==${TORCH_VERSION} && \
    pip install --no-cache-dir --no-binary=mpi4py mpi4py && \
    # CuPy 14 is the first with bfloat16 arrays (ml_dtypes), which bf16 gradients need.
    pip install --no-cache-dir numpy numba ml_dtypes "cupy-cuda12x>=14" scikit-learn matplotlib tqdm cloudpickle psutil pyyaml packaging \
        pytest pytest-timeout hypothesis

COPY scripts/build_horovod.sh /opt/pacmpi/scripts/build_horovod.sh
RUN HOROVOD_GPU_OPERATIONS=NCCL bash /opt/pacmpi/scripts/build_horovod.sh /opt/venv/bin/python /tmp/wheels && \
    pip install --no-cache-dir --no-deps /tmp/wheels/horovod-*.whl && rm -rf /tmp/wheels && \
    python -c "import horovod.torch"

COPY . /opt/pacmpi
RUN pip install --no-cache-dir --no-deps /opt/pacmpi && pacmpi info
WORKDIR /opt/pacmpi
CMD ["pacmpi", "--help"]
