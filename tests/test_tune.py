"""``pacmpi tune``: the real command at 2 ranks on a tiny size, the lines it prints read back
by a fresh job's MPI library, a bogus algorithm refused, and its rules file read by Open MPI."""
import os
import sys

import pytest

from pacmpi.launch.mpi import detect_mpi
from pacmpi.launch.tune import Candidate, openmpi_algorithms, rules_file

from mpi_util import mpirun_argv, run_bounded

OPENMPI = detect_mpi().kind == "openmpi"
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(not OPENMPI, reason="the tests' MPI is not Open MPI")]
PROBE = ("from mpi4py import MPI; import numpy as np; "
         "from pacmpi.collectives import allreduce_algorithm; "
         "print('RAN', allreduce_algorithm(MPI), flush=True); "
         "print('NBC', allreduce_algorithm(MPI, nonblocking=True), flush=True)")


def tune(*args):
    return run_bounded([sys.executable, "-m", "pacmpi.cli", "tune", "-n", "2", "--oversubscribe",
                        *args], timeout=240, env=dict(os.environ), what="pacmpi tune")


def test_tune_names_a_real_algorithm_whose_lines_take_effect(tmp_path):
    done = tune("--sizes", "4K", "--iters", "2", "--algorithms", "ring,3",
                "--json", str(tmp_path / "tune.json"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    winner = next(line.split(": ")[1] for line in lines if line.startswith("  4 KiB: "))
    assert winner in {"ring", "recursive_doubling"}
    assert winner in openmpi_algorithms(detect_mpi()).values()  # the library's own names
    exports = dict(line[len("export "):].split("=", 1) for line in lines
                   if line.startswith("export O"))
    number = {"ring": "4", "recursive_doubling": "3"}[winner]
    assert exports == {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1",
                       "OMPI_MCA_coll_tuned_allreduce_algorithm": number}
    assert f"checked: a fresh 2-rank job with these lines ran {winner}, every sum exact" in lines
    # The printed lines, exported by hand into a plain mpirun job: its library runs the winner.
    probe = run_bounded(mpirun_argv(2) + [sys.executable, "-c", PROBE], timeout=60,
                        env=dict(os.environ, **exports), what="probe")
    assert sorted(line for line in probe.stdout.splitlines() if line.startswith("RAN")) == \
        [f"RAN {winner}"] * 2, probe.stderr
    assert '"checked": "' + winner in (tmp_path / "tune.json").read_text()


def test_tune_nonblocking_times_libnbc_and_its_line_takes_effect(tmp_path):
    done = tune("--sizes", "4K,64K", "--iters", "2", "--nonblocking", "--algorithms",
                "ring,binomial", "--json", str(tmp_path / "tune.json"))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("pacmpi tune: Open MPI 5.")
    assert "non-blocking (Iallreduce, in place), 2 ranks" in lines[0]
    assert lines[1].split() == ["size", "ring", "binomial", "fastest"]
    export = [line for line in lines if line.startswith("export O")]
    assert len(export) == 1  # libnbc takes no rules file: one algorithm for every size
    name, _, number = export[0][len("export "):].partition("=")
    assert name == "OMPI_MCA_coll_libnbc_iallreduce_algorithm" and number in {"1", "2"}
    winner = {"1": "ring", "2": "binomial"}[number]
    assert f"checked: a fresh 2-rank job with these lines ran {winner}, every sum exact" in lines
    # Exported by hand into a plain mpirun job: the non-blocking call runs the winner, the
    # blocking one is untouched (coll/tuned's own choice).
    probe = run_bounded(mpirun_argv(2) + [sys.executable, "-c", PROBE], timeout=60,
                        env=dict(os.environ, **{name: number}), what="probe")
    assert sorted(line for line in probe.stdout.splitlines() if line[:3] in ("RAN", "NBC")) == \
        [f"NBC {winner}"] * 2 + ["RAN default"] * 2, probe.stderr
    assert '"nonblocking": true' in (tmp_path / "tune.json").read_text()


def test_a_bogus_algorithm_is_refused_naming_it():
    done = tune("--sizes", "4K", "--algorithms", "ring,99")
    assert done.returncode == 2
    assert "all-reduce algorithm '99' is not one of Open MPI's: default, 1 basic_linear" \
        in done.stderr
    assert "4 ring" in done.stderr and "ran" not in done.stdout  # nothing was timed
    # The non-blocking list is libnbc's own: segmented_ring is coll/tuned's, not libnbc's.
    done = tune("--sizes", "4K", "--nonblocking", "--algorithms", "segmented_ring")
    assert done.returncode == 2
    assert ("non-blocking all-reduce algorithm 'segmented_ring' is not one of Open MPI's: "
            "default, 1 ring, 2 binomial, 3 rabenseifner, 4 recursive_doubling") in done.stderr


def test_open_mpi_reads_the_rules_file_by_size_range(tmp_path):
    ring, bogus = Candidate("ring", 4, ()), Candidate("bogus", 99, ())
    text = rules_file([(4096, ring), (65536, ring), (1 << 20, bogus)], 2)
    # one collective, all-reduce (2), one comm size, 2 ranks, two rules from 0 and 256 KiB
    assert text == "1\n2\n1\n2\n2\n0 4 0 0\n262144 99 0 0\n"
    path = tmp_path / "rules.conf"
    path.write_text(text)
    # Below 256 KiB the ring sums; above it the bogus algorithm 99 must make Open MPI fail:
    # it read the file and chose by size (a missing file would be ignored silently).
    code = ("from mpi4py import MPI; import numpy as np\n"
            "for n in (1024, 1 << 20):\n"
            "    a = np.ones(n // 4, np.float32); b = np.empty_like(a)\n"
            "    try:\n        MPI.COMM_WORLD.Allreduce(a, b); print('SUMMED', n, b[0])\n"
            "    except MPI.Exception as exc:\n        print('REFUSED', n, exc.Get_error_class()"
            " == MPI.ERR_ARG)\n")
    env = dict(os.environ, OMPI_MCA_coll_tuned_use_dynamic_rules="1",
               OMPI_MCA_coll_tuned_dynamic_rules_filename=str(path))
    done = run_bounded(mpirun_argv(2) + [sys.executable, "-c", code], timeout=60, env=env,
                       what="rules file")
    lines = sorted(line for line in done.stdout.splitlines() if line[:1] in "SR")
    assert lines == ["REFUSED 1048576 True"] * 2 + ["SUMMED 1024 2.0"] * 2, done.stderr
