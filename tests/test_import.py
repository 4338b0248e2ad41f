"""The core's import graph: ``import pacmpi`` loads no framework and does not start MPI, and no
module under ``pacmpi/`` imports the adapters or the launch helpers (they sit above it)."""
import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[1] / "pacmpi"
UPPER = ("pacmpi.adapters", "pacmpi.launch")


def test_import_pacmpi_loads_no_framework():
    code = ("import sys, pacmpi, pacmpi.bench.allreduce, pacmpi.cli, pacmpi.info; "
            "bad = [m for m in ('torch', 'horovod', 'cupy') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_import_pacmpi_does_not_initialize_mpi():
    code = "import sys, pacmpi; sys.exit(1 if 'mpi4py.MPI' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def _module_name(path, root):
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node, module, is_package):
    """The absolute module names an ``import``/``from ... import`` node refers to."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = module if is_package else module.rpartition(".")[0]
    if node.level:
        base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
        package = ".".join(base)
        target = f"{package}.{node.module}" if node.module else package
    else:
        target = node.module
    # `from pacmpi import launch` names a module too.
    return [target] + [f"{target}.{alias.name}" for alias in node.names]


def upward_imports(root=CORE):
    """``[(file, line, name)]`` for every import under ``root`` of an adapters/launch module."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        module = _module_name(path, root)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _absolute(node, module, path.name == "__init__.py"):
                    if any(name == up or name.startswith(up + ".") for up in UPPER):
                        found.append((str(path.relative_to(root.parent)), node.lineno, name))
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant)
                  and str(node.args[0].value).startswith(UPPER)):
                # importlib.import_module("pacmpi.adapters...") is the same dependency, hidden.
                found.append((str(path.relative_to(root.parent)), node.lineno,
                              node.args[0].value))
    return found


def test_core_imports_neither_adapters_nor_launch():
    assert upward_imports() == []


@pytest.mark.parametrize("where, source, name", [
    ("cli.py", "import pacmpi.adapters.train\n", "pacmpi.adapters.train"),
    ("cli.py", "from pacmpi.launch import run_command\n", "pacmpi.launch"),
    ("cli.py", "from pacmpi import launch\n", "pacmpi.launch"),
    ("cli.py", "from .launch import doctor\n", "pacmpi.launch"),
    ("bench/x.py", "from ..adapters import pruning\n", "pacmpi.adapters"),
    ("bench/deep/x.py", "from ...launch.mpi import detect_mpi\n", "pacmpi.launch.mpi"),
    ("cli.py", "importlib.import_module('pacmpi.adapters.horovod')\n", "pacmpi.adapters.horovod"),
])
def test_upward_import_check_catches_every_spelling(tmp_path, where, source, name):
    # Negative control: the check must see each way of writing the forbidden import.
    path = tmp_path / "pacmpi" / where
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    assert name in [found[2] for found in upward_imports(tmp_path / "pacmpi")]


def test_upward_import_check_allows_the_core_itself(tmp_path):
    path = tmp_path / "pacmpi" / "bench" / "x.py"
    path.parent.mkdir(parents=True)
    path.write_text("from ..faults import run_main\nfrom . import allreduce\nimport numpy\n")
    assert upward_imports(tmp_path / "pacmpi") == []
