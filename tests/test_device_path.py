"""The device path on CPUs: pacmpi's CuPy code run on tests/host_cupy.py's stand-in.

Under mpirun on 2 and 4 ranks (tests/mpi_scripts/device_scenarios.py): host staging exactly
when MPI is not CUDA-aware or the dtype has no device sum, one stream synchronization before
every MPI call that reads device memory, staged results copied back (blocking and not), and
PacTrainReducer on device arrays (gpu.py's kernels compiled for the host) bit-identical to the
NumPy run, lossless and ternary; each rule has a negative control. Here: the stand-in keeps
what those checks rely on, and tensors cross adapters.convert as zero-copy views both ways.

Only a GPU checks: MPI reading real device pointers (CUDA-aware Open MPI/UCX), CuPy's own
stream semantics (asynchronous kernels, ``get``/``set`` ordering), torch's stream handed to
CuPy in the DDP hook, NCCL, CuPy's bfloat16 and DLPack of CUDA tensors, nvcc's code and speed.
"""
import sys
import threading

import numpy as np
import pytest

from pacmpi.arrays import array_module, is_device_array, synchronize, to_host

import host_cuda
import host_cupy
from mpi_util import SHARED_TIMEOUT, run_scenarios, scenario_cases, shared_launches

MODULE = "device_scenarios.py"


@pytest.mark.timeout(SHARED_TIMEOUT + 60)  # the first scenario of a launch waits for all of it
@pytest.mark.parametrize("ranks, scenario", scenario_cases(MODULE, shared_launches(MODULE)))
def test_device_scenario(ranks, scenario):
    run_scenarios(MODULE, ranks).check(scenario)


# ------------------------------------------------------------------ the stand-in
@pytest.fixture
def cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", host_cupy)
    return host_cupy


def test_pacmpi_sees_device_arrays(cupy):
    device, host = cupy.arange(4.0), np.arange(4.0)
    assert is_device_array(device) and array_module(device) is cupy
    assert not is_device_array(host) and array_module(host) is np
    with cupy.recording() as log:
        copied = to_host(device)
    assert type(copied) is np.ndarray and [e.kind for e in log] == ["get"]


def test_results_stay_on_the_device(cupy):
    device = cupy.arange(6, dtype=np.float32)
    for result in (device + 1, device.sum(), cupy.max(device), np.max(device), device[[0, 2]],
                   cupy.divmod(device, 4)[1], cupy.flatnonzero(device)):
        assert type(result) is cupy.ndarray


def test_mixing_device_and_host_arrays_is_refused(cupy):
    device, host = cupy.zeros(3), np.zeros(3)
    for mixed in (lambda: device + host, lambda: host * device,
                  lambda: cupy.concatenate([device, host]), lambda: np.stack([device, host])):
        with pytest.raises(TypeError, match="NumPy array among device arrays"):
            mixed()
    device + cupy.asarray(host)  # control: copied to the device first


def test_set_checks_as_cupy(cupy):
    device = cupy.zeros((2, 3), dtype=np.float32)
    for bad, error in ((cupy.zeros((2, 3), np.float32), TypeError),
                       (np.zeros((2, 3), np.float64), TypeError),
                       (np.zeros(6, np.float32), ValueError)):
        with pytest.raises(error):
            device.set(bad)
    with pytest.raises(RuntimeError, match="non-contiguous"):
        device[:, ::2].set(np.zeros((2, 2), np.float32))
    device.set(np.ones((2, 3), np.float32))
    assert device.get().sum() == 6


def test_synchronize_waits_for_the_current_stream(cupy):
    """pacmpi.arrays.synchronize on the stand-in: the current stream of this thread, an
    external one inside its block; NumPy needs none."""
    seen = []
    with cupy.recording() as log:
        synchronize(np)
        synchronize(cupy)
        with cupy.cuda.ExternalStream(0xABC):
            synchronize(cupy)
            worker = threading.Thread(target=lambda: seen.append(
                cupy.cuda.get_current_stream().name))
            worker.start()
            worker.join()
    assert [(e.kind, e.stream) for e in log] == [("sync", "null"), ("sync", "external 0xabc")]
    assert seen == ["null"]  # streams are current per thread, as CuPy's


def test_kernel_launches_are_logged(cupy):
    if host_cuda.compiler() is None:
        pytest.skip("needs a C++ compiler for the host CUDA route")
    from pacmpi.kernels import gpu

    module = cupy.RawModule(code=gpu.SOURCE, options=gpu.OPTIONS,
                            name_expressions=list(gpu.expressions()))
    payload, indices = cupy.arange(2, dtype=np.float32), cupy.arange(2, dtype=np.int64)
    flat = cupy.zeros(5, dtype=np.float32)
    name = gpu._expression("scatter", np.float32, np.float32, np.int64)
    with cupy.recording() as log:
        module.get_function(name)(
            (1,), (32,), (payload, indices, np.int32(1), flat, np.float32(1), np.int32(0),
                          np.int64(2)))
    assert [(e.kind, e.what) for e in log] == [("work", name)]
    assert flat.get().tolist() == [0, 1, 0, 0, 0]


# ------------------------------------------------------------------ tensors <-> arrays
def test_from_dlpack_views_the_tensor(cupy):
    """The stand-in's from_dlpack shares the tensor's memory, as CuPy's does a CUDA tensor's."""
    torch = pytest.importorskip("torch")
    tensor = torch.zeros(3)
    device = cupy.from_dlpack(tensor)
    device[1] = 5
    assert type(device) is cupy.ndarray and tensor.tolist() == [0, 5, 0]


@pytest.mark.parametrize("name", ["float16", "float32", "float64", "bfloat16"])
@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_tensors_and_arrays_share_memory(name, layout):
    """as_array/as_tensor are views: a write through either side is seen on the other, and
    the round trip comes back to the same storage and dtype."""
    torch = pytest.importorskip("torch")
    from pacmpi.adapters import convert

    dtype = getattr(torch, name)
    base = torch.arange(24, dtype=dtype).reshape(4, 6)
    tensor = base if layout == "contiguous" else base[:, 1::2].t()
    array = convert.as_array(tensor)
    assert array.dtype.name == name and array.shape == tuple(tensor.shape)
    array[1, 2] = 100
    assert tensor[1, 2].item() == 100
    tensor[2, 0] = -7
    assert array[2, 0] == -7
    back = convert.as_tensor(array)
    assert back.dtype == dtype and back.data_ptr() == tensor.data_ptr()
    assert back.stride() == tensor.stride()
    back[0, 0] = 3
    assert tensor[0, 0].item() == 3 and array[0, 0] == 3
    assert torch.equal(back, tensor)
