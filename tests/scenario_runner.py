"""Run a scenario module's tests with pytest on one rank of a job, and record every outcome.

Usage (on every rank, under mpirun, torchrun or horovodrun):
    python tests/scenario_runner.py REPORT_DIR PYTEST_ARGS...

PYTEST_ARGS name the tests, of one module or of several run in turn in one process.

Every rank runs the same tests in the same order, so their collectives stay matched, and
appends one JSON line per test phase to ``REPORT_DIR/rank<r>.jsonl`` as soon as the phase
ends: a job that crashes or hangs later still reports what finished before. The outer test
(``mpi_util.run_scenarios``) reads the files and reports each scenario on its own.
"""
import json
import os
import sys
from pathlib import Path

import pytest

# Where each launcher puts the rank (Open MPI, MPICH/Hydra, horovodrun --gloo, torchrun).
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "HOROVOD_RANK", "RANK")


def launcher_rank():
    for name in RANK_VARIABLES:
        if name in os.environ:
            return int(os.environ[name])
    raise RuntimeError(f"no rank in the environment: none of {RANK_VARIABLES} is set; start "
                       "this under mpirun, torchrun or horovodrun")


class RankReport:
    """pytest plugin: one JSON line per collection error, test phase and session end."""

    def __init__(self, path):
        self.file = open(path, "a", encoding="utf-8")

    def write(self, **record):
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def pytest_collectreport(self, report):
        if report.failed:
            self.write(event="collect", outcome="failed", text=report.longreprtext)

    def pytest_collection_finish(self, session):
        self.write(event="collected", tests=[item.nodeid for item in session.items])

    def pytest_runtest_logreport(self, report):
        # A launch may run several modules (mpi_util.SHARED_LAUNCHES), whose tests may share
        # a name: each outcome names its module too.
        path, _, test = report.nodeid.rpartition("::")
        self.write(event=report.when, module=Path(path).name, test=test,
                   outcome=report.outcome, text=report.longreprtext if not report.passed else "")

    def pytest_sessionfinish(self, exitstatus):
        self.write(event="finished", exitstatus=int(exitstatus))
        self.file.close()


def main(report_dir, *pytest_args):
    path = Path(report_dir) / f"rank{launcher_rank()}.jsonl"
    # The plugins installed in the environment (hypothesis's above all) cost every rank of
    # every launch up to 2 s to load; scenarios use none of them, only pytest's own fixtures.
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    # No conftest: the outer suite's session fixtures are not the scenarios' business; no
    # cache: every rank would write the same .pytest_cache.
    return pytest.main(["--noconftest", "-p", "no:cacheprovider", "-q", "--color=no", *pytest_args],
                       plugins=[RankReport(path)])


if __name__ == "__main__":
    status = int(main(*sys.argv[1:]))
    # Every outcome is already in the report. Leave without interpreter finalization: torch
    # 2.13's gloo can abort a finished process while the interpreter is torn down
    # ("terminate called without an active exception"), which would fail a launch whose
    # scenarios all passed. os._exit keeps pytest's exit status.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
