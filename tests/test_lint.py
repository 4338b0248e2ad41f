"""The whole tree passes the linter configured in pyproject.toml (ruff)."""
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _ruff():
    local = Path(sys.executable).parent / "ruff"
    return str(local) if local.exists() else shutil.which("ruff")


def test_ruff_is_clean():
    ruff = _ruff()
    assert ruff, "ruff is not installed: `make setup` installs it"
    result = subprocess.run([ruff, "check", "--no-cache", str(REPO)], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_catches_an_unused_import(tmp_path):
    # Negative control: the configuration really reports something.
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n")
    result = subprocess.run([_ruff(), "check", "--no-cache", "--config",
                             str(REPO / "pyproject.toml"), str(bad)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "F401" in result.stdout, result.stdout + result.stderr
