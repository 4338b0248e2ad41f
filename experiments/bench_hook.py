"""``pacmpi bench hook``: measure pacmpi's own cost per step in the DDP hook and the Horovod
compressor (memory by component, time per step against the number of parameter tensors); rank 0
prints a table per part and ``--json`` writes them.

Run it on 2+ ranks: ``mpirun -n 2 pacmpi bench hook`` (or under ``torchrun``; gloo on CPU).

``--part memory``: ``--layers`` ``Linear(width, width)`` layers (on the same input, their
outputs summed: :class:`_Branches`), weights pruned to each density under random masks
(biases unpruned), trained a few steps with plain DDP
(``gradient_as_bucket_view=True``), with :func:`pactrain_hook` lossless and ternary; or, with
``--frontend horovod``, with ``hvd.DistributedOptimizer`` without and with a
:class:`PacTrainCompressor`. Columns as ``pacmpi bench memory``: each component the engine keeps
between steps (:meth:`pacmpi.engine.StepEngine.memory_report`, live arrays), then ``peak`` (NumPy
allocations, tracemalloc) and ``rss``: the peak resident memory above plain DDP's (Horovod's) run
of the same model, all as ratios of the gradient bytes. The masks are the user's, made before
the measurement starts, as the model is. Torch's own temporaries (Horovod's copies; the
hook's concatenation of masks it cannot lay out in one storage) show in ``rss`` only.

``--part time``: DDP (gloo, one thread per rank) of such ``Linear(width, width)`` layers
with the given numbers of parameter tensors at about the same parameter count (the width
shrinks as the layers multiply), weights pruned 0.5; plain DDP, the hook lossless and ternary;
the median step (forward, backward, the all-reduces) over ``--steps`` after warm-up steps, the
slowest rank's, every model stepped in turn (so every row sees the machine's drift alike), and
pacmpi's own time in it (the hook's calls and its decodes): wall time,
which includes the verification all-reduce's wait for the slower rank and a decode's waits for
the GIL (the transport's thread decodes while the training thread runs Python), and CPU time
(``time.thread_time`` of the thread each of those calls ran on), which includes neither.

``--device cuda`` (DDP only, NCCL, a GPU per rank): the same on CUDA tensors. ``peak`` is then
the device memory above plain DDP's run of the same model: torch's peak allocation
(``torch.cuda.max_memory_allocated``) plus what CuPy's memory pool holds at the end (it keeps
the blocks it ever used until freed, so that is its high-water mark); ``rss`` stays the host's.
scripts/gpu_check.sh runs it.
"""
import atexit
import functools
import gc
import os
import time

import numpy as np
import torch
from torch import nn

from pacmpi import kernels
from pacmpi.bench import harness
from pacmpi.bench.memory import (
    COMPONENTS,
    ResidentPeak,
    fixed_mmap_threshold,
    random_mask,
    ratio_row,
)
from pacmpi.bench.memory import format_table as format_memory_table
from pacmpi.cli_options import add_densities, add_device, add_json_file, command_parser

__all__ = ["run_memory", "run_time", "main"]

MODES = {"plain": "plain", "lossless": None, "ternary": "ternary"}


class _Branches(nn.ModuleList):
    """``Linear`` layers on the same input, their outputs summed. Not a chain: through 200
    chained ``Linear(20, 20)`` the gradients vanish (median 2e-28, 12% of them subnormal
    floats, whose arithmetic costs the CPU about 100x), so a step's time would measure the
    gradients' values, not the number of tensors; here every layer's gradient is of one size."""

    def forward(self, x):
        return torch.stack([layer(x) for layer in self]).sum(0)


def _stack(layers, width, seed=0, device="cpu"):
    torch.manual_seed(seed)
    return _Branches([nn.Linear(width, width) for _ in range(layers)]).to(device)


def _masks(model, density):
    return {name: torch.from_numpy(random_mask(p.numel(), density, seed=i).reshape(p.shape))
            .to(p.device)
            for i, (name, p) in enumerate(model.named_parameters()) if name.endswith("weight")}


def _grad_bytes(model):
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _init_ddp(device="cpu"):
    import torch.distributed as dist

    if "RANK" not in os.environ and "OMPI_COMM_WORLD_RANK" in os.environ:  # under mpirun
        os.environ.update(RANK=os.environ["OMPI_COMM_WORLD_RANK"],
                          WORLD_SIZE=os.environ["OMPI_COMM_WORLD_SIZE"],
                          MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    return dist


def _comm_device(dist):
    """Where the process group's tensors must live: NCCL takes CUDA tensors only."""
    return "cuda" if dist.get_backend() == "nccl" else "cpu"


class DevicePeak:
    """:class:`ResidentPeak` on a GPU: ``peak`` is torch's peak allocation plus the growth of
    CuPy's memory pool (pacmpi's arrays on CUDA) above :meth:`start`; ``rss`` the host's."""

    def start(self):
        import cupy

        self._pool = cupy.get_default_memory_pool()
        torch.cuda.synchronize()
        self._pool.free_all_blocks()
        torch.cuda.reset_peak_memory_stats()
        self._torch, self._cupy = torch.cuda.memory_allocated(), self._pool.total_bytes()
        self._host = ResidentPeak().start()
        return self

    def stop(self):
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - self._torch
                + self._pool.total_bytes() - self._cupy)
        return {"peak": peak, "rss": self._host.stop()["rss"]}


# ---------------------------------------------------------------- DDP
class _Job:
    """One DDP model trained by :meth:`step` (``mode`` "plain", or the hook lossless or
    ternary with ``masks``: the user's, else made here at ``density``), timing pacmpi's own
    calls: the hook's and its decodes, wall and this thread's CPU seconds."""

    def __init__(self, dist, model, density, mode, masks=None, batch=32):
        from torch.nn.parallel import DistributedDataParallel as DDP

        from pacmpi.adapters.ddp import PacTrainHookState, pactrain_hook

        self.dist, self.model = dist, model
        self.ddp = DDP(model, gradient_as_bucket_view=True)
        self.state, self._own = None, [0.0, 0.0]
        if mode == "control":
            self._control_hook(model)
        elif mode != "plain":
            masks = _masks(model, density) if masks is None else masks
            self.state = PacTrainHookState(model, masks, quantize=MODES[mode],
                                           error_feedback=mode == "ternary")  # its largest case
            timed = self._timed

            @timed
            def hook(state, bucket):
                if state.engine is None:  # made at the first call: its decodes, on the
                    state.bind()  # transport's thread, count too (CPU: that thread's)
                    state.engine.decode = timed(state.engine.decode)
                return pactrain_hook(state, bucket)

            self.ddp.register_comm_hook(self.state, hook)
        width, self._device = model[0].in_features, model[0].weight.device
        generator = torch.Generator().manual_seed(dist.get_rank())
        self._inputs = torch.randn(batch, width, generator=generator).to(self._device)

    def _control_hook(self, model):
        """DDP's default all-reduce, after pacmpi reduces a gradient of its own inside the hook:
        one tensor of the model's parameter count, masked at 0.5, lossless, the same every
        step (timed as pacmpi's). What pacmpi's time does with the model's number of tensors
        when its work does not depend on it at all: the control for the "pacmpi" rows."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        from pacmpi import PacTrainReducer
        from pacmpi.adapters.torch_collectives import TorchDistCollectives

        size = sum(p.numel() for p in model.parameters())
        grad = np.random.default_rng(0).standard_normal(size).astype(np.float32)
        reducer = PacTrainReducer([random_mask(size, 0.5, seed=0)],
                                  collectives=TorchDistCollectives())
        reduce = self._timed(reducer.reduce)

        def hook(state, bucket):
            reduce([grad])
            return allreduce_hook(state, bucket)

        self.ddp.register_comm_hook(None, hook)

    @property
    def engine(self):
        return self.state.engine if self.state else None

    def _timed(self, call):
        """``call``, adding its wall and this thread's CPU seconds to the job's."""
        own = self._own

        @functools.wraps(call)  # DDP reads the hook's parameter names
        def run(*args):
            started, cpu = time.perf_counter(), time.thread_time()
            try:
                return call(*args)
            finally:
                own[0] += time.perf_counter() - started
                own[1] += time.thread_time() - cpu
        return run

    def step(self):
        """One step (after a barrier): its (seconds, pacmpi's wall seconds, its CPU seconds)."""
        self.dist.barrier()
        before = np.array(self._own)
        started = time.perf_counter()
        self.ddp(self._inputs).square().mean().backward()
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
        elapsed = time.perf_counter() - started
        mine, cpu = np.array(self._own) - before
        self.model.zero_grad(set_to_none=False)
        return elapsed, mine, cpu


def run_memory(dist, layers=8, width=1024, densities=(1.0, 0.5, 0.2),
               modes=("lossless", "ternary"), steps=4, device="cpu"):
    kernels.warm_up([np.float32])  # compile (or load) the kernels: not a step's memory
    for mode in ("plain",) + tuple(modes):  # warm torch's allocator
        job = _Job(dist, _stack(2, 64, device=device), 0.5, mode)
        for _ in range(2):
            job.step()
    rows = []
    for density in densities:
        baseline = None
        for mode in ("plain",) + tuple(modes):
            model = _stack(layers, width, device=device)
            masks = _masks(model, density)  # the user's, as the model: not pacmpi's memory
            peak = (DevicePeak() if device == "cuda" else ResidentPeak()).start()
            job = _Job(dist, model, density, mode, masks=masks)
            for _ in range(steps):
                job.step()
            engine = job.engine
            peaks = peak.stop()
            report = engine.memory_report() if engine else {}
            del engine
            if mode == "plain":
                baseline = peaks
            else:
                # On a GPU the peak counts the model and DDP's buckets too: above plain DDP's.
                peaks = {"peak": peaks["peak"] - (baseline["peak"] if device == "cuda" else 0),
                         "rss": None if peaks["rss"] is None else
                         peaks["rss"] - baseline["rss"]}
                rows.append(_max_over_ranks(dist, ratio_row(
                    report, _grad_bytes(model), peaks, frontend="ddp", mode=mode,
                    density=density)))
            del model, masks, job
            gc.collect()
    return rows


def _max_over_ranks(dist, row):
    keys = [k for k in COMPONENTS + ("kept", "peak", "rss") if row.get(k) is not None]
    values = torch.tensor([row[k] for k in keys], dtype=torch.float64, device=_comm_device(dist))
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    row.update(zip(keys, values.tolist()))
    return row


def run_time(dist, tensors=(40, 400), width=64, steps=20, modes=("plain", "lossless",
                                                                   "ternary"), device="cpu",
             in_turn=True):
    """Rows per (tensors, mode): ms per step, pacmpi's ms in it and its CPU ms, each the
    median over ``steps`` steps (after 3 untimed ones), the slowest rank's. The first count
    uses ``Linear(width, width)``; the others the width giving about the same parameter count.
    ``in_turn``: every model is stepped in turn, one step each, so that all rows see the
    machine as it is at the same moments (on a shared machine the speed drifts within a run),
    and each step runs after the other models' (as a training step runs after the optimizer's
    and the data loader's work: pacmpi's code and arrays are not left in the CPU's caches by
    the step before); else each model's steps run back to back, one model after another."""
    torch.set_num_threads(1)
    layers0 = tensors[0] // 2
    params = layers0 * (width * width + width)
    jobs = {}
    for count in tensors:
        layers = count // 2
        w = width if count == tensors[0] else _width_for(params // layers)
        for mode in modes:
            jobs[count, mode] = _Job(dist, _stack(layers, w, device=device), 0.5, mode)
    times = {key: [] for key in jobs}
    order = [(i, key) for i in range(3 + steps) for key in jobs] if in_turn else \
        [(i, key) for key in jobs for i in range(3 + steps)]
    for i, key in order:
        measured = jobs[key].step()
        if i >= 3:
            times[key].append(measured)
    rows = []
    for (count, mode), job in jobs.items():
        medians = torch.tensor(np.median(times[count, mode], axis=0), dtype=torch.float64,
                               device=_comm_device(dist))
        dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's
        step, mine, cpu = (float(t) * 1e3 for t in medians.tolist())
        model = job.model
        rows.append({"tensors": count, "layers": len(model), "width": model[0].in_features,
                     "params": sum(p.numel() for p in model.parameters()), "mode": mode,
                     "step_ms": step, "pacmpi_ms": mine if mode != "plain" else None,
                     "pacmpi_cpu_ms": cpu if mode != "plain" else None})
    return rows


def _width_for(params_per_layer):
    """The width whose ``Linear(w, w)`` has about ``params_per_layer`` parameters."""
    return max(1, round((-1 + (1 + 4 * params_per_layer) ** 0.5) / 2))


def format_time_table(rows):
    return harness.format_table(rows, [
        ("tensors", "tensors", ">7"), ("layers", "layers", ">6"), ("width", "width", ">5"),
        ("params", "params", ">8"), ("mode", "mode", "<8"), ("step(ms)", "step_ms", ">9.2f"),
        ("pacmpi(ms)", "pacmpi_ms", ">10.2f"), ("cpu(ms)", "pacmpi_cpu_ms", ">8.2f")])


# ---------------------------------------------------------------- Horovod
def run_memory_horovod(layers=8, width=1024, densities=(1.0, 0.5, 0.2),
                       modes=("lossless", "ternary"), steps=4):
    import horovod.torch as hvd

    from pacmpi.adapters.horovod import PacTrainCompressor

    hvd.init()
    torch.set_num_threads(1)
    kernels.warm_up([np.float32])
    rows = []
    # The first pass (a small model) loads the kernels and warms the allocators; not reported.
    for density, width, report in [(0.5, 64, False)] + [(d, width, True) for d in densities]:
        baseline = None
        for mode in ("plain",) + tuple(modes):
            model = _stack(layers, width)
            masks = _masks(model, density)  # the user's, as the model: not pacmpi's memory
            peak = ResidentPeak().start()
            compression = hvd.Compression.none
            if mode != "plain":
                compression = PacTrainCompressor(model, masks,
                                                 quantize=MODES[mode],
                                                 average=mode == "ternary",
                                                 error_feedback=mode == "ternary")
            optimizer = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.0),
                named_parameters=model.named_parameters(), compression=compression,
                op=hvd.Sum if mode == "ternary" else hvd.Average)
            inputs = torch.randn(32, width)
            for _ in range(steps):
                optimizer.zero_grad()
                model(inputs).square().mean().backward()
                optimizer.step()
            peaks = peak.stop()
            if mode == "plain":
                baseline = peaks
            elif report:
                peaks["rss"] = None if peaks["rss"] is None else peaks["rss"] - baseline["rss"]
                row = ratio_row(compression.memory_report(), _grad_bytes(model),
                                peaks, frontend="horovod", mode=mode, density=density)
                keys = [k for k in COMPONENTS + ("kept", "peak", "rss") if row[k] is not None]
                maxima = hvd.allreduce(torch.tensor([row[k] for k in keys],
                                                   dtype=torch.float64), op=hvd.Max)
                row.update(zip(keys, maxima.tolist()))
                rows.append(row)
            del model, optimizer, compression, masks
            gc.collect()
    return rows, hvd.rank(), hvd.size()


# ---------------------------------------------------------------- command
def build_parser(parser=None):
    parser = parser or command_parser("pacmpi bench hook", __doc__)
    parser.add_argument("--part", choices=("memory", "time", "all"), default="all",
                        help="which measurement: memory by component, time per step, or both")
    parser.add_argument("--frontend", choices=("ddp", "horovod"), default="ddp",
                        help="memory part: the DDP hook or the Horovod compressor")
    parser.add_argument("--layers", type=int, default=8, metavar="N",
                        help="memory part: Linear layers")
    parser.add_argument("--width", type=int, default=1024, metavar="N",
                        help="memory part: their width (inputs = outputs)")
    add_densities(parser, "1.0,0.5,0.2", "memory part: weight densities")
    parser.add_argument("--tensors", default="40,400", metavar="N,N",
                        help="time part: parameter tensors per model (2 per layer), "
                             "comma-separated")
    parser.add_argument("--time-width", type=int, default=64, metavar="N",
                        help="time part: the width at the first tensor count")
    parser.add_argument("--steps", type=int, default=20, metavar="N",
                        help="time part: timed steps")
    parser.add_argument("--control", action="store_true",
                        help="time part: add a control row per tensor count: DDP's default "
                             "all-reduce, pacmpi reducing one fixed tensor in the hook")
    parser.add_argument("--back-to-back", action="store_true",
                        help="time part: each model's steps back to back (default: the models "
                             "stepped in turn, one step each)")
    add_device(parser, "DDP on CPU (gloo) or on CUDA tensors (NCCL, a GPU per rank)")
    add_json_file(parser, "the report")
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    fixed_mmap_threshold()  # before the transports start their threads
    densities = [float(d) for d in args.densities.split(",")]
    report, rank, size = {}, 0, 1
    if args.frontend == "horovod":
        if args.part == "time" or args.device != "cpu":
            raise SystemExit("pacmpi bench hook: --part time and --device cuda are for DDP")
        report["memory"], rank, size = run_memory_horovod(args.layers, args.width, densities)
    else:
        dist = _init_ddp(args.device)
        rank, size = dist.get_rank(), dist.get_world_size()
        # Time first: the memory part leaves tracemalloc on (ResidentPeak.stop), which slows
        # every allocation after it.
        if args.part in ("time", "all"):
            report["time"] = run_time(dist, [int(t) for t in args.tensors.split(",")],
                                      args.time_width, args.steps, device=args.device,
                                      in_turn=not args.back_to_back,
                                      modes=("plain", "lossless", "ternary")
                                      + ("control",) * args.control)
        if args.part in ("memory", "all"):
            report["memory"] = run_memory(dist, args.layers, args.width, densities,
                                          device=args.device)
    if rank == 0:
        if "memory" in report:
            print(f"{args.frontend} memory per rank, ratio of the gradient bytes "
                  f"({args.layers} x Linear({args.width}, {args.width}), {size} ranks; rss "
                  f"above the run without pacmpi)")
            print(format_memory_table(report["memory"]))
        if "time" in report:
            print(f"DDP step time, {'NCCL on CUDA' if args.device == 'cuda' else 'gloo'}, "
                  f"{size} ranks, 1 thread per rank, weights pruned 0.5, median of {args.steps} "
                  f"steps, the models {'one after another' if args.back_to_back else 'in turn'}")
            print(format_time_table(report["time"]))
        if args.json:
            order = "back to back" if args.back_to_back else "in turn"
            harness.write_report(args.json, dict(report, ranks=size, device=args.device,
                                                  steps_order=order),
                                 "pacmpi bench hook")
    if args.frontend == "ddp":  # gloo may abort a finished rank at interpreter exit
        from pacmpi.experiments.train import exit_after_gloo

        atexit.register(exit_after_gloo, 0)
    return 0
