"""``pacmpi.experiments.train``: argument handling locally, the job end to end under mpirun."""
import sys

import pytest

from pacmpi.experiments import train

from mpi_util import run_mpi  # tests/ is put on sys.path by conftest.py


def test_parse_gradual():
    assert train.parse_gradual("10:0.5,20:0.8") == [(10, 0.5), (20, 0.8)]
    with pytest.raises(ValueError, match="step:ratio"):
        train.parse_gradual("10")


@pytest.mark.parametrize("config, message", [
    ({"method": "int8"}, "unknown method 'int8'"),
    ({"dataset": "cifar10"}, "needs --data-dir"),
    ({"resume": True}, "needs --checkpoint"),
    ({"learning_rate": 1}, "unknown config keys"),
    ({"method": "dgc", "optimizer": "adam"}, "corrects SGD momentum"),
    ({"method": "dense", "error_feedback": False}, "no-error-feedback applies to"),
    ({"method": "dgc", "bias_probe": True}, "bias-probe needs"),
    ({"method": "pactrain", "backend": "ddp", "bias_probe": True}, "bias-probe needs"),
    ({"method": "terngrad", "backend": "horovod"}, "run --method topk|terngrad|dgc"),
])
def test_config_validation(config, message):
    with pytest.raises(ValueError, match=message):
        train.run(config)


def test_parser_covers_every_config_field():
    args = train.build_parser().parse_args(["--method", "topk", "--topk-ratio", "0.02",
                                            "--no-progress", "--gradual", "5:0.5"])
    assert args.method == "topk" and args.topk_ratio == 0.02 and args.progress is False
    assert train._config(args).gradual == "5:0.5"


def test_horovod_backend_fails_clearly_without_horovod(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # import raises ImportError
    cfg = train._config({"backend": "horovod"})
    with pytest.raises(RuntimeError, match="--backend horovod needs horovod.torch"):
        train._HorovodSync(cfg, None, None, {}, None)


@pytest.mark.mpi
def test_every_method_end_to_end_on_two_ranks(tmp_path):
    result = run_mpi("train_e2e.py", 2, "methods", tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for method in ("dense", "fp16", "pactrain", "pactrain-ternary", "topk", "json"):
        assert f"OK {method}" in result.stdout, result.stdout + result.stderr


@pytest.mark.mpi
def test_resumed_run_is_bit_identical(tmp_path):
    result = run_mpi("train_e2e.py", 2, "resume", tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "OK resume: bit-identical" in result.stdout, result.stdout + result.stderr


def test_watchdog_option_is_parsed_and_validated():
    from pacmpi.experiments.train import parse_watchdog

    assert parse_watchdog("60") == (60.0, None)
    assert parse_watchdog("60,600") == (60.0, 600.0)
    for bad in ("abc", "0", "1,2,3", "-5"):
        with pytest.raises(ValueError, match=f"got {bad!r}"):
            parse_watchdog(bad)


@pytest.mark.mpi
def test_baselines_error_feedback_and_bias_probe_on_two_ranks(tmp_path):
    result = run_mpi("train_baselines_e2e.py", 2, tmp_path, timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    for line in ("OK terngrad", "OK dgc", "OK bias probe", "OK error feedback off"):
        assert line in result.stdout, result.stdout + result.stderr
