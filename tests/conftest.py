import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from mpi_util import SUITE_ENV  # noqa: E402

for _name, _value in SUITE_ENV.items():  # every launch the suite makes inherits these
    os.environ.setdefault(_name, _value)
from testbed_leaks import testbed_leak_check  # noqa: E402,F401  (session-wide leak check)


@pytest.fixture
def launcher_tmpdir(monkeypatch):
    """A private TMPDIR for launchers and for this process's ``tempfile``, short enough for
    the PMIx rendezvous socket Open MPI puts under it (a socket path has at most 107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="pm-", dir="/tmp"))
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)
