"""The README runs as written: its training-script snippet on 2 ranks, and every quick-start
command from a shell in which the venv is NOT activated (the quick start's own first line
activates it), in a scratch directory so that nothing lands in the checkout."""
import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from mpi_util import run_bounded, run_mpi
from pacmpi.launch import probe_testbed
from pacmpi.launch.doctor import usable_cpus

README = Path(__file__).resolve().parents[1] / "README.md"
ACTIVATE = "source .venv/bin/activate"
RANKS_IN_README = 4


@pytest.mark.mpi
def test_readme_training_snippet_runs_on_two_ranks():
    result = run_mpi("readme_quickstart.py", 2, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("OK readme") == 2


def quick_start():
    """``(commands, comments)`` of the README's quick-start block, comments stripped."""
    block = README.read_text().split("## Quick start", 1)[1].split("```bash\n", 1)[1]
    lines = block.split("```", 1)[0].splitlines()
    commands = [re.sub(r"\s+#.*$", "", line) for line in lines
                if line.strip() and not line.startswith("#")]
    return commands, "\n".join(line for line in lines if line.startswith("#"))


COMMANDS, COMMENTS = quick_start()


def short_run(command, cache):
    """Flags appended to keep a command to seconds (the README shows the plain form); with
    argparse the last occurrence of a flag wins."""
    if "bench train" in command:
        return (f" --quick --methods dense-fp32 --sweep-ratios '' --epochs 1 "
                f"--no-plots --timeout 150 --cache-dir {cache}")
    if "bench allreduce" in command:
        return " --sizes 64K --densities 1.0,0.2 --iters 1 --warmup 0"
    if re.search(r"(pacmpi|pacmpi\.cli) train ", command):
        return (f" --epochs 1 --max-steps 2 --pretrain-epochs 1 --width 8 --hidden 64 "
                f"--no-progress --pretrained {cache}/pretrained.pt")
    return ""


def plain_mpirun_flags():
    """What the README's comment tells a user to add to plain ``mpirun`` here."""
    flags = []
    if os.geteuid() == 0:
        flags.append("--allow-run-as-root")
    if usable_cpus()[0] < RANKS_IN_README:
        flags.append("--oversubscribe")
    return flags


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A working directory with ``.venv`` pointing at the venv these tests run in."""
    where = tmp_path_factory.mktemp("quickstart")
    (where / ".venv").symlink_to(sys.prefix)
    (where / "cache").mkdir()
    return where


def fresh_shell_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PACMPI_", "OMPI_", "PRTE_", "PMIX_")) and k != "VIRTUAL_ENV"}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(d for d in env.get("PATH", "").split(os.pathsep)
                                  if d != venv_bin)
    return env


def test_quick_start_starts_by_activating_the_venv():
    assert COMMANDS[0] == ACTIVATE
    for flag in plain_mpirun_flags():  # the test adds only what the README says to add
        assert flag in COMMENTS


EXPECTED = [  # (what identifies the command, what its output must contain)
    ("pacmpi doctor", "every required part works"),
    ("pacmpi info", "bits/value"),
    ("bench allreduce", "#wrong"),
    ("bench train", "== link none (2 ranks) =="),
    (" train ", ""),
]


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(330)
@pytest.mark.parametrize("command", COMMANDS[1:])
def test_quick_start_command_runs_as_written(command, scratch):
    if "--link" in command:
        problem = probe_testbed()
        if problem:
            pytest.skip(f"the shaped test bed is unavailable here: {problem}")
    line = command + short_run(command, scratch / "cache")
    if line.startswith("mpirun "):
        line = " ".join(["mpirun", *plain_mpirun_flags(), line[len("mpirun "):]])
    done = run_bounded(["bash", "-c", f"cd {shlex.quote(str(scratch))} && {ACTIVATE} && {line}"],
                       timeout=300, env=fresh_shell_env(), what=line)
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    expected = next(text for key, text in EXPECTED if key in command)
    assert expected in done.stdout, done.stdout[-3000:]
