"""`make demo`'s own parts: which link it runs on (scripts/demo_link.sh) and the table it ends
with (scripts/demo_report.py, from the JSON that scripts/demo_train.py writes)."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pacmpi.experiments import bench_train
from pacmpi.launch.testbed import probe_testbed

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"
VENV_BIN = str(Path(sys.executable).parent)


def run_script(argv, **env):
    """A demo script as `make demo` runs it: the venv's python first on PATH."""
    env = {**os.environ, "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", **env}
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


# ---------------------------------------------------------------------------------- the link
def test_link_is_shaped_exactly_when_the_launchers_check_says_it_can():
    done = run_script(["bash", str(SCRIPTS / "demo_link.sh")])
    assert done.returncode == 0, done.stderr
    problem = probe_testbed()
    assert done.stdout == ("none\n" if problem else "100mbit\n")
    if problem:  # says why, in one line
        assert done.stderr == (f"demo: cannot shape a 100mbit link here, so running unshaped "
                               f"(every method then shows about the same time per step): "
                               f"{problem}\n")
    else:
        assert done.stderr == ""


def test_link_falls_back_to_unshaped_in_one_line_when_tc_is_missing():
    """No mock: a PATH without iproute2's tc (on Debian it lives in /usr/sbin only), so the
    launcher's own check fails as on a machine without it (or without root)."""
    path = os.pathsep.join([VENV_BIN, "/usr/bin", "/bin"])
    if os.geteuid() == 0 and shutil.which("tc", path=path):
        pytest.skip("tc is on the reduced PATH here too")
    done = run_script(["bash", str(SCRIPTS / "demo_link.sh")], PATH=path)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "none\n"
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("demo: cannot shape a 100mbit link here, so "
                                                   "running unshaped"), done.stderr
    assert ("`tc`" if os.geteuid() == 0 else "needs root") in lines[0]


def test_link_env_var_turns_shaping_off_and_picks_the_rate():
    done = run_script(["bash", str(SCRIPTS / "demo_link.sh")], PACMPI_DEMO_LINK="none")
    assert (done.returncode, done.stdout) == (0, "none\n")
    assert done.stderr == "demo: running unshaped (PACMPI_DEMO_LINK=none)\n"
    if probe_testbed() is None:  # a rate of one's own goes through the same check
        done = run_script(["bash", str(SCRIPTS / "demo_link.sh")], PACMPI_DEMO_LINK="1gbit")
        assert (done.returncode, done.stdout, done.stderr) == (0, "1gbit\n", "")


# ---------------------------------------------------------------------------------- the table
def _run(label, ratio, step_seconds, accuracies, bytes_per_step):
    """One method's record as bench_train.summarize_run writes it (the fields the demo uses);
    an epoch every 10 steps."""
    method = label.rsplit("-", 1)[0] if ratio else label
    return {"label": label, "method": method, "ratio": ratio, "parameters": 283882,
            "pretrained_accuracy": 0.9, "final_accuracy": accuracies[-1],
            "bytes_per_step": bytes_per_step,
            "step_seconds": {"seconds": step_seconds, "compute": 0.02, "optimizer": 0.005},
            "curve": [{"epoch": e, "wall_seconds": 10 * step_seconds * (e + 1),
                       "train_seconds": 10 * step_seconds * (e + 1), "test_accuracy": a}
                      for e, a in enumerate(accuracies)]}


def _report(tmp_path, link, runs):
    """The JSON demo_train.py writes (through bench_train.derive), then the printed table."""
    report = {"config": {"ranks": 4, "epochs": 3, "link": link},
              "rates": {link: {"status": "ok", "error": None, "calibration": [], "failed": {},
                               "runs": {run["label"]: run for run in runs}}}}
    bench_train.derive(report, 0.98)
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(report))
    done = run_script([sys.executable, str(SCRIPTS / "demo_report.py"), str(path)])
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def _row(lines, name):
    (line,) = [line for line in lines if line.startswith(name + "  ")]
    return line[len(name):].split()


def test_report_table_time_to_target_speedup_and_never(tmp_path):
    # dense's final 0.95: target 0.931, first reached after epoch 1 (0.94 > 0.931 > 0.92).
    lines = _report(tmp_path, "100mbit", [
        _run("dense", 0.0, 0.5, [0.92, 0.94, 0.95], 1_000_000),
        _run("pactrain-0.8", 0.8, 0.125, [0.93, 0.94, 0.96], 250_000),
        # reaches 0.931 nowhere: "never", and no speedup
        _run("pactrain-ternary-0.8", 0.8, 0.1, [0.90, 0.91, 0.93], 25_000)])
    assert lines[0] == ("link: 100.0 Mbit/s, one shared link shaped by pacmpi-run --link; "
                        "4 ranks; digits CNN (283,882 parameters), 3 epochs")
    assert lines[1].split() == ["method", "ms/step", "to", "target", "(s)", "x", "dense",
                                "bytes/step", "accuracy"]
    assert _row(lines, "dense fp32 all-reduce") == ["500", "10.0", "1.00", "1,000,000",
                                                    "0.9500"]
    # also reached after its epoch 1 (0.93 < 0.931): 2.5 s against dense's 10 s
    assert _row(lines, "PacTrain, 80% pruned") == ["125", "2.5", "4.00", "250,000", "0.9600"]
    assert _row(lines, "PacTrain+ternary, 80% pruned") == ["100", "never", "-", "25,000",
                                                           "0.9300"]
    assert "target: test accuracy 0.9310 = 98% of dense's final (pretrained model: 0.9000)" \
        in lines[5]
    assert "never = not within 3 epochs" in lines[6]
    assert lines[7] == ("dense's step: 500 ms, of which 25 ms compute: 95% is communication "
                        "(and waiting for other ranks)")


def test_report_names_an_unshaped_link(tmp_path):
    lines = _report(tmp_path, "none", [_run("dense", 0.0, 0.05, [0.92, 0.95], 1_000_000)])
    assert lines[0].startswith("link: unshaped (the host's own transport); 4 ranks;")
