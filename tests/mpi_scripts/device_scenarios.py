"""pacmpi's device path on CPUs under mpirun (tests/test_device_path.py): CuPy is the stand-in
of tests/host_cupy.py, and the communicator a proxy that logs every MPI call moving array data,
with where its buffers live, into the stand-in's event log (beside device work, host copies and
stream synchronizations). :func:`log_problems` reads a log for what a GPU would punish:

- placement: a device buffer reaches MPI only when it is CUDA-aware, and a float16/bfloat16
  one only to be broadcast (MPI has no device sum for them);
- ordering: when MPI reads device memory, no stream has work not yet synchronized; a copy to
  the host (``get``, ordered after its own stream's work) finds none on another stream;
- count: exactly one synchronization before each MPI call that reads device memory, at most
  one before any other.

The stand-in's arrays live in host memory, so a missing synchronization or staging would give
the right numbers anyway: the log is how they are seen, and each rule has a negative control.
"""
import contextlib
import pickle
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from pacmpi import PacTrainReducer, kernels
from pacmpi import collectives as collectives_module
from pacmpi.arrays import supported_float_dtypes
from pacmpi.collectives import MPICollectives
from pacmpi.half_sum import half_dtypes
from pacmpi.hierarchy import HierarchicalCollectives

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for host_cupy
import host_cuda  # noqa: E402
import host_cupy  # noqa: E402

host_cupy.install()

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
DTYPES = supported_float_dtypes()
HALF = {dtype.name for dtype in half_dtypes()}
# The kernels' route on device arrays: gpu.py's CUDA source compiled for the host where a C++
# compiler exists, else the NumPy reference (which runs on any array module).
DEVICE_KERNELS = "auto" if host_cuda.compiler() else "numpy"
# The recording communicator stands in for a CUDA-aware library (the stand-in's "device" arrays
# are host memory, so MPI reads them safely): the library's own answer, no CUDA support here,
# would make cuda_aware=True refuse. "Cannot say" keeps cuda_aware="auto" at host staging.
collectives_module.cuda_support = lambda MPI: (None, "the tests' stand-in for a GPU")


class RecordingComm(MPI.Intracomm):
    """An mpi4py communicator (the same MPI one) that logs each call moving array data as an
    ``mpi`` event, ``what=(call, ((place, dtype), ...))`` with place ``device`` or ``host``,
    then makes it; a nonblocking call's request logs its ``Wait``; communicators made from it
    record too."""

    def _logged(self, call, args, kwargs):
        host_cupy.record("mpi", (call, _places(args)))
        return getattr(super(), call)(*args, **kwargs)

    def Allreduce(self, *args, **kwargs):  # noqa: N802  (mpi4py's names)
        return self._logged("Allreduce", args, kwargs)

    def Iallreduce(self, *args, **kwargs):  # noqa: N802
        return RecordingRequest(self._logged("Iallreduce", args, kwargs))

    def Reduce(self, *args, **kwargs):  # noqa: N802
        return self._logged("Reduce", args, kwargs)

    def Bcast(self, *args, **kwargs):  # noqa: N802
        return self._logged("Bcast", args, kwargs)

    def Dup(self, *args, **kwargs):  # noqa: N802
        return RecordingComm(super().Dup(*args, **kwargs))

    def Split(self, *args, **kwargs):  # noqa: N802
        return RecordingComm(super().Split(*args, **kwargs))


class RecordingRequest:
    def __init__(self, request):
        self._request = request

    def Wait(self):  # noqa: N802  (mpi4py's name)
        host_cupy.record("mpi", ("Wait", ()))
        return self._request.Wait()


def _places(args):
    """Where the arrays among an MPI call's arguments live: ``(place, dtype name)`` each."""
    places = []
    for arg in args:
        for item in arg if isinstance(arg, list) else [arg]:  # [buf, count, datatype]
            if isinstance(item, np.ndarray):
                place = "device" if isinstance(item, host_cupy.ndarray) else "host"
                places.append((place, item.dtype.name))
    return tuple(places)


def log_problems(log, cuda_aware):
    """What in ``log`` breaks the rules of the module docstring, one line each."""
    problems, pending, syncs = [], set(), 0
    for i, event in enumerate(log):
        if event.kind in ("work", "set"):
            pending.add(event.stream)
        elif event.kind == "sync":
            pending.discard(event.stream)
            syncs += 1
        elif event.kind == "get":
            if pending - {event.stream}:
                problems.append(f"event {i}: a copy to the host on {event.stream} while "
                                f"{sorted(pending - {event.stream})} have unsynchronized work")
            pending.discard(event.stream)
        elif event.kind == "mpi" and event.what[0] != "Wait":
            call, places = event.what
            device = [dtype for place, dtype in places if place == "device"]
            for dtype in device:
                if not cuda_aware:
                    problems.append(f"event {i}: {call} got a {dtype} device buffer, but MPI "
                                    "is not CUDA-aware")
                elif dtype in HALF and call != "Bcast":
                    problems.append(f"event {i}: {call} got a {dtype} device buffer; MPI has "
                                    "no device sum for it")
            if device and pending:
                problems.append(f"event {i}: {call} reads device memory while {sorted(pending)} "
                                "have unsynchronized work")
            if syncs not in ((1,) if device else (0, 1)):
                problems.append(f"event {i}: {syncs} synchronizations before {call} "
                                f"({'device' if device else 'host'} buffers)")
            syncs = 0
    return problems


def transport(cuda_aware):
    return MPICollectives(comm=RecordingComm(MPI.COMM_WORLD).Dup(), cuda_aware=cuda_aware)


# ------------------------------------------------------------------ one collective at a time
CALLS = ("allreduce", "iallreduce", "reduce", "bcast")
MPI_NAMES = {"allreduce": "Allreduce", "iallreduce": "Iallreduce", "reduce": "Reduce",
             "bcast": "Bcast"}


def run_call(collectives, call, buf):
    if call == "iallreduce":
        request = collectives.iallreduce(buf)
        host_cupy.record("waiting")  # the request is pending until here
        request.wait()
    elif call == "reduce":
        collectives.reduce(buf, root=SIZE - 1)
    else:
        getattr(collectives, call)(buf)


def expected_events(call, cuda_aware, dtype):
    """The one right sequence of (kind, detail) for ``call`` on a device buffer."""
    name = MPI_NAMES[call]
    staged = not cuda_aware or (dtype.name in HALF and call != "bcast")
    place = "host" if staged else "device"
    events = [("sync", None)] + ([("get", dtype.name)] if staged else [])
    events.append(("mpi", (name, ((place, dtype.name),))))
    if call == "iallreduce":
        events += [("waiting", None), ("mpi", ("Wait", ()))]
    if staged and (call != "reduce" or RANK == SIZE - 1):
        events.append(("set", dtype.name))
    return events


def expected_values(call, values):
    """The result of ``call`` on every rank's ``values * (rank + 1)``, on this rank."""
    if call == "bcast":
        return values
    if call == "reduce" and RANK != SIZE - 1:
        return values * (RANK + 1)
    return values * (SIZE * (SIZE + 1) // 2)


def one_call(collectives, call, dtype):
    """Run ``call`` on a device buffer after some device work; returns (events, problems,
    whether the buffer ended right)."""
    values = np.arange(-6, 7).astype(dtype)  # small integers: every sum is exact
    buf = host_cupy.asarray(values)
    with host_cupy.recording() as log:
        buf *= dtype.type(RANK + 1)  # device work the collective must wait for
        run_call(collectives, call, buf)
    events = [(e.kind, e.what) for e in log[1:]]
    exact = np.array_equal(buf.get().view(f"u{dtype.itemsize}"),
                           expected_values(call, values).astype(dtype).view(f"u{dtype.itemsize}"))
    return events, log_problems(log, collectives.cuda_aware), exact


def test_staging_and_synchronization():
    """Each collective, blocking and not, CUDA-aware or not, on every dtype: host-staged
    exactly when needed, one synchronization before MPI, results (copied back) exact."""
    for cuda_aware in (False, True):
        collectives = transport(cuda_aware)
        for dtype in DTYPES:
            for call in CALLS:
                case = f"{call} {dtype} cuda_aware={cuda_aware}"
                events, problems, exact = one_call(collectives, call, dtype)
                assert events == expected_events(call, cuda_aware, dtype), case
                assert problems == [], case
                assert exact, case


def test_host_buffers_are_not_synchronized():
    """NumPy buffers go to MPI as they are, with no stream synchronization."""
    collectives = transport(True)
    buf = np.arange(5.0)
    with host_cupy.recording() as log:
        collectives.allreduce(buf)
    assert [(e.kind, e.what) for e in log] == [("mpi", ("Allreduce", (("host", "float64"),)))]
    assert log_problems(log, True) == []
    assert np.array_equal(buf, np.arange(5.0) * SIZE)


# ------------------------------------------------------------------ negative controls
def test_a_missing_synchronization_is_seen(monkeypatch):
    monkeypatch.setattr(collectives_module, "synchronize", lambda xp: None)
    events, problems, exact = one_call(transport(True), "allreduce", np.dtype(np.float32))
    assert exact  # the stand-in cannot race: only the log shows it
    assert any("unsynchronized work" in p for p in problems), problems


def test_an_extra_synchronization_is_seen(monkeypatch):
    def twice(xp):
        xp.cuda.get_current_stream().synchronize()
        xp.cuda.get_current_stream().synchronize()

    monkeypatch.setattr(collectives_module, "synchronize", twice)
    problems = one_call(transport(True), "allreduce", np.dtype(np.float64))[1]
    assert any("2 synchronizations before Allreduce" in p for p in problems), problems


def test_skipped_staging_is_seen(monkeypatch):
    monkeypatch.setattr(MPICollectives, "_needs_staging", lambda self, buf, reduces: False)
    events, problems, exact = one_call(transport(False), "allreduce", np.dtype(np.float32))
    assert exact
    assert any("MPI is not CUDA-aware" in p for p in problems), problems
    problems = one_call(transport(True), "iallreduce", np.dtype(np.float16))[1]
    assert any("no device sum" in p for p in problems), problems


def test_a_result_left_on_the_host_is_seen(monkeypatch):
    monkeypatch.setattr(collectives_module._StagedRequest, "wait",
                        collectives_module._MPIRequest.wait)
    events, problems, exact = one_call(transport(False), "iallreduce", np.dtype(np.float32))
    assert not exact
    assert ("set", "float32") not in events


def test_work_on_another_stream_is_seen():
    """Gradients made on one stream (torch's) and reduced on another: MPI, or the staging copy,
    would read them before they are written."""
    for cuda_aware, problem in ((True, "reads device memory while"),
                                (False, "a copy to the host on null while")):
        collectives = transport(cuda_aware)
        buf = host_cupy.zeros(4, dtype=np.float32)
        with host_cupy.recording() as log:
            with host_cupy.cuda.ExternalStream(0x7E57):
                buf += 1
            collectives.allreduce(buf)
        problems = log_problems(log, cuda_aware)
        assert any(problem in p for p in problems), problems


# ------------------------------------------------------------------ PacTrainReducer
SHAPES = ((6, 5), (31,), (3, 4, 2), (9,))


def make_transport(cuda_aware, hierarchical):
    """MPICollectives on a recording duplicate of COMM_WORLD; hierarchical: over nodes of
    two consecutive ranks."""
    if not hierarchical:
        return transport(cuda_aware)
    world = RecordingComm(MPI.COMM_WORLD)
    return HierarchicalCollectives(comm=world.Dup(), node_comm=world.Split(RANK // 2),
                                   cuda_aware=cuda_aware)


def reducer_run(device, quantize, cuda_aware, blocking, hierarchical, stream):
    """Four steps of a PacTrainReducer over every dtype, masks changing at step 2, on device
    arrays (with ``stream`` current, when given) or NumPy arrays; returns every step's results
    (host copies), the final residuals and the event log."""
    rng = np.random.default_rng(5)
    shapes = [s for _ in DTYPES for s in SHAPES]
    dtypes = [d for d in DTYPES for _ in SHAPES]
    masks = [rng.random(s) < 0.6 if i % 4 != 3 else None for i, s in enumerate(shapes)]
    move = host_cupy.asarray if device else np.asarray
    masks = [None if m is None else move(m) for m in masks]
    reducer = PacTrainReducer(masks, collectives=make_transport(cuda_aware, hierarchical),
                              quantize=quantize, bucket_bytes=256, abort_on_error=False,
                              error_feedback=quantize == "ternary")
    kernels.set_backend(DEVICE_KERNELS if device else None)
    results = []
    try:
        with host_cupy.recording() as log, stream or contextlib.nullcontext():
            for step in range(4):
                if step == 2:
                    masks[0][...] = ~masks[0]  # same change on every rank
                data = np.random.default_rng(100 * step + RANK)
                grads = [move(data.standard_normal(s).astype(d)) for s, d in zip(shapes, dtypes)]
                if blocking:
                    reducer.reduce(grads)
                else:
                    reducer.start(grads)
                    reducer.wait(grads)
                results.append([host_cupy.asnumpy(g) for g in grads])
    finally:
        kernels.set_backend(None)
    residuals = reducer.state_dict()["residuals"]
    return results, residuals, log


def assert_bit_identical(device_run, host_run, case):
    for step, (on_device, on_host) in enumerate(zip(device_run[0], host_run[0])):
        for i, (a, b) in enumerate(zip(on_device, on_host)):
            assert type(a) is np.ndarray and a.dtype == b.dtype, case
            assert a.tobytes() == b.tobytes(), f"{case}: step {step}, gradient {i}"
    assert device_run[1].keys() == host_run[1].keys(), case
    for b, residual in host_run[1].items():
        assert device_run[1][b].tobytes() == residual.tobytes(), f"{case}: residual {b}"


# (cuda_aware, blocking, hierarchical, on torch's stream): each both ways.
VARIANTS = ((False, True, False, False), (True, True, False, False), (False, False, False, True),
            (True, False, False, True), (False, True, True, False), (True, True, True, False))


def check_reducer(quantize):
    for cuda_aware, blocking, hierarchical, external in VARIANTS:
        case = (f"quantize={quantize} cuda_aware={cuda_aware} blocking={blocking} "
                f"hierarchical={hierarchical} external stream={external}")
        stream = host_cupy.cuda.ExternalStream(0x5EED) if external else None
        on_device = reducer_run(True, quantize, cuda_aware, blocking, hierarchical, stream)
        on_host = reducer_run(False, quantize, cuda_aware, blocking, hierarchical, None)
        assert_bit_identical(on_device, on_host, case)
        assert log_problems(on_device[2], cuda_aware) == [], case
        places = {place for e in on_device[2] if e.kind == "mpi" for place, _ in e.what[1]}
        assert ("device" in places) == cuda_aware, case


def test_reducer_lossless_matches_numpy():
    """Lossless packed reductions of device gradients equal the NumPy run bit for bit."""
    check_reducer(None)


def test_reducer_ternary_matches_numpy():
    """Ternary codes and residuals from device gradients equal the NumPy run bit for bit."""
    check_reducer("ternary")


def test_checkpoint_resumes_on_the_device():
    """Ternary residuals saved from device arrays (to host), pickled and loaded into a new
    reducer go back to the device: the resumed run equals the uninterrupted one bit for bit,
    and one that starts without them does not."""
    shapes = ((7, 3), (20,))

    def reducer():
        mask = host_cupy.asarray(np.random.default_rng(1).random(shapes[0]) < 0.5)
        return PacTrainReducer([mask, None], collectives=transport(False), quantize="ternary",
                               error_feedback=True, shapes=shapes, dtypes=["float32"] * 2,
                               abort_on_error=False)

    def step(run, number):
        data = np.random.default_rng(number + 10 * RANK)
        grads = [host_cupy.asarray(data.standard_normal(s).astype(np.float32)) for s in shapes]
        run.reduce(grads)
        return b"".join(g.get().tobytes() for g in grads)

    kernels.set_backend(DEVICE_KERNELS)
    try:
        whole, first = reducer(), reducer()
        expected = [step(whole, n) for n in range(4)]
        for n in range(2):
            step(first, n)
        state = pickle.loads(pickle.dumps(first.state_dict()))
        resumed, fresh = reducer(), reducer()
        resumed.load_state_dict(state)
        fresh.load_state_dict(dict(state, residuals={}))
        assert [step(resumed, n) for n in (2, 3)] == expected[2:]
        assert [step(fresh, n) for n in (2, 3)] != expected[2:]
    finally:
        kernels.set_backend(None)
