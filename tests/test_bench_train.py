"""Tests for ``pacmpi bench train``: TTA/speedup arithmetic on hand-made records, a quick
end-to-end run (unshaped, 2 ranks, tiny model) checking the JSON schema and plots, and the
refusal of a rate whose calibration fails (skipped without root / network namespaces)."""
import contextlib
import io
import json
import math
import os
import sys
from pathlib import Path

import pytest

from pacmpi.experiments.bench_train import (
    DDP_METHODS,
    FULL,
    TEXT,
    MethodSpec,
    _pretrain,
    _train_argv,
    add_tta,
    build_parser,
    check_nodes,
    compose_timing,
    derive,
    expand_methods,
    format_table,
    job_command,
    main,
    merge_reports,
    overlap,
    parse_method,
    speedup,
    spread,
    throughput_stats,
    time_to_accuracy,
)
from pacmpi.launch import run_command

from doc_snippets import REPO
from mpi_util import netns_skip_reason

PY = sys.executable
TINY = ["--ranks", "2", "--epochs", "2", "--width", "8", "--hidden", "64",
        "--pretrain-epochs", "1", "--timeout", "120"]


@pytest.fixture(autouse=True)
def venv_not_activated(monkeypatch):
    """The venv's bin off PATH, as for `.venv/bin/pacmpi bench train` from a fresh shell: the
    harness must find mpirun beside its Python by itself."""
    keep = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d != str(Path(PY).parent)]
    monkeypatch.setenv("PATH", os.pathsep.join(keep))
    monkeypatch.delenv("PACMPI_MPIRUN", raising=False)
    monkeypatch.delenv("PACMPI_TORCHRUN", raising=False)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """One pretrained-model cache for the module: pretraining runs once."""
    return tmp_path_factory.mktemp("pretrained")


def _curve(points):
    """``[(wall, train, accuracy), ...]`` -> curve records."""
    return [{"epoch": i, "wall_seconds": w, "train_seconds": t, "test_accuracy": a}
            for i, (w, t, a) in enumerate(points)]


# --- arithmetic ----------------------------------------------------------------------------

def test_time_to_accuracy_first_crossing_and_never():
    curve = _curve([(10, 8, 0.90), (20, 16, 0.96), (30, 24, 0.95), (40, 32, 0.97)])
    assert time_to_accuracy(curve, 0.96) == (20, 1)  # reaching it counts (>=)
    assert time_to_accuracy(curve, 0.965, key="train_seconds") == (32, 3)
    assert time_to_accuracy(curve, 0.99) == (None, None)
    assert time_to_accuracy(curve, None) == (None, None)


def test_speedup():
    assert speedup(40.0, 10.0) == 4.0
    assert speedup(None, 10.0) is None and speedup(40.0, None) is None


def test_add_tta_targets_dense_and_fills_speedups():
    runs = {
        "dense": {"final_accuracy": 0.98, "curve": _curve([(40, 36, 0.95), (80, 72, 0.98)])},
        "fp16": {"final_accuracy": 0.98, "curve": _curve([(20, 18, 0.95), (40, 36, 0.98)])},
        "pactrain-0.8": {"final_accuracy": 0.97,
                         "curve": _curve([(5, 4, 0.961), (10, 8, 0.97)])},
        "topk-1%": {"final_accuracy": 0.90, "curve": _curve([(8, 7, 0.85), (16, 14, 0.90)])},
    }
    target = add_tta(runs, 0.98)
    assert target == pytest.approx(0.98 * 0.98)  # 0.9604
    assert runs["dense"]["tta_seconds"] == 80 and runs["dense"]["tta_epoch"] == 1
    assert runs["fp16"]["tta_seconds"] == 40
    pt = runs["pactrain-0.8"]
    assert (pt["tta_seconds"], pt["tta_train_seconds"], pt["tta_epoch"]) == (5, 4, 0)
    assert pt["speedup_vs_dense"] == 16.0 and pt["speedup_vs_fp16"] == 8.0
    assert pt["train_speedup_vs_dense"] == 18.0 and pt["train_speedup_vs_fp16"] == 9.0
    assert runs["dense"]["speedup_vs_dense"] == 1.0
    assert runs["dense"]["speedup_vs_fp16"] == 0.5
    topk = runs["topk-1%"]
    assert topk["reached_target"] is False and topk["tta_seconds"] is None
    assert topk["speedup_vs_dense"] is None and topk["speedup_vs_fp16"] is None


def test_add_tta_without_dense_run_reports_nothing():
    runs = {"pactrain-0.8": {"final_accuracy": 0.97, "curve": _curve([(5, 4, 0.97)])}}
    assert add_tta(runs, 0.98) is None
    assert runs["pactrain-0.8"]["tta_seconds"] is None
    assert runs["pactrain-0.8"]["speedup_vs_dense"] is None


def test_throughput_stats_interval_brackets_mean():
    steps = [{"seconds": s, "samples": 128} for s in (5.0, 5.0, 0.5, 0.4, 0.6, 0.5)]
    stats = throughput_stats(steps, warmup=2)
    assert stats["steps"] == 4
    assert stats["mean"] == pytest.approx(128 / 0.5)
    assert stats["ci95_low"] < stats["mean"] < stats["ci95_high"]
    flat = throughput_stats([{"seconds": 0.25, "samples": 64}] * 5, warmup=0)
    assert flat["ci95_low"] == flat["mean"] == flat["ci95_high"] == 256


def test_parse_method_labels_and_negative_controls():
    assert parse_method("dense") == MethodSpec("dense", "dense", 0.0)
    assert parse_method("fp16", 0.5) == MethodSpec("fp16", "fp16", 0.5)
    # The spellings before one vocabulary still parse, to today's labels.
    assert parse_method("dense-fp32") == MethodSpec("dense", "dense", 0.0)
    assert parse_method("dense-fp16", 0.5) == MethodSpec("fp16", "fp16", 0.5)
    assert parse_method("topk-1%") == MethodSpec("topk-1%", "topk", 0.0, 0.01)
    assert parse_method("pactrain-0.8") == MethodSpec("pactrain-0.8", "pactrain", 0.8)
    assert parse_method("pactrain-ternary-0.8").method == "pactrain-ternary"
    for bad in ("dense-fp8", "topk-0%", "topk-1", "pactrain-1.0", "pactrain-ternary", "fp32"):
        with pytest.raises(ValueError, match="unknown method label"):
            parse_method(bad)


def test_parse_baseline_and_no_error_feedback_labels():
    assert parse_method("terngrad") == MethodSpec("terngrad", "terngrad", 0.0)
    assert parse_method("dgc-0.1%") == MethodSpec("dgc-0.1%", "dgc", 0.0, 0.001)
    assert parse_method("topk-1%-noef") == MethodSpec("topk-1%-noef", "topk", 0.0, 0.01,
                                                      error_feedback=False)
    spec = parse_method("pactrain-ternary-0.0-noef")
    assert (spec.method, spec.ratio, spec.error_feedback) == ("pactrain-ternary", 0.0, False)
    assert parse_method("pactrain-ternary-0.8").error_feedback is True
    spec = parse_method("pactrain-ternary-0-noef-block4096")
    assert (spec.ratio, spec.error_feedback, spec.ternary_scale) == (0.0, False, 4096)
    assert parse_method("pactrain-ternary-0.5-block64").ternary_scale == 64
    assert parse_method("pactrain-ternary-0.5").ternary_scale == "tensor"
    argv = _train_argv(dict(FULL), spec, None, "x.json", 0)
    assert argv[argv.index("--ternary-scale") + 1] == "4096"
    # error feedback exists only where there is a residual, a ternary scale with ternary
    for bad in ("pactrain-0.8-noef", "dgc-1%-noef", "terngrad-noef",
                "ddp-pactrain-ternary-0.8-noef", "dgc-0%", "dgc", "pactrain-0.5-block64",
                "pactrain-ternary-0.5-block0", "pactrain-ternary-0.5-block-noef"):
        with pytest.raises(ValueError, match="unknown method label"):
            parse_method(bad)


def test_parse_ddp_method_labels_and_negative_controls():
    assert parse_method("ddp-dense") == MethodSpec("ddp-dense", "dense", 0.0, backend="ddp")
    assert parse_method("ddp-fp16", 0.5) == MethodSpec("ddp-fp16", "fp16", 0.5, backend="ddp")
    assert parse_method("ddp-powersgd-1") == MethodSpec("ddp-powersgd-1", "powersgd", 0.0,
                                                        backend="ddp", powersgd_rank=1)
    assert parse_method("ddp-powersgd-4").powersgd_rank == 4
    assert parse_method("ddp-pactrain-0.8") == MethodSpec("ddp-pactrain-0.8", "pactrain", 0.8,
                                                          backend="ddp")
    assert parse_method("ddp-pactrain-ternary-0.8") == MethodSpec(
        "ddp-pactrain-ternary-0.8", "pactrain-ternary", 0.8, backend="ddp")
    assert parse_method("pactrain-0.8").backend == "mpi"
    for bad in ("ddp", "ddp-", "ddp-dense-fp32", "ddp-fp32", "ddp-powersgd", "ddp-powersgd-0",
                "ddp-powersgd-1.5", "ddp-topk-1%", "ddp-pactrain-1.0", "ddp-pactrain-ternary",
                "DDP-dense"):
        with pytest.raises(ValueError, match="unknown method label.*ddp-powersgd-K"):
            parse_method(bad)


def test_parse_sharded_labels_and_negative_controls():
    assert parse_method("pactrain-0.8-sharded") == MethodSpec(
        "pactrain-0.8-sharded", "pactrain", 0.8, sharded=True)
    assert parse_method("ddp-pactrain-0.8-sharded") == MethodSpec(
        "ddp-pactrain-0.8-sharded", "pactrain", 0.8, backend="ddp", sharded=True)
    assert parse_method("ddp-dense-sharded", 0.5) == MethodSpec(
        "ddp-dense-sharded", "dense", 0.5, backend="ddp", sharded=True)
    assert parse_method("pactrain-0.8").sharded is False
    argv = _train_argv(dict(FULL), parse_method("ddp-dense-sharded"), None, "x.json", 0)
    assert "--sharded" in argv and argv[argv.index("--backend") + 1] == "ddp"
    assert "--sharded" not in _train_argv(dict(FULL), parse_method("ddp-dense"), None, "x.json",
                                          0)
    for bad in ("dense-sharded", "fp16-sharded", "ddp-fp16-sharded", "topk-1%-sharded",
                "pactrain-ternary-0.8-sharded", "ddp-powersgd-4-sharded", "-sharded",
                "pactrain-0.8-sharded-sharded", "dense-fp32-sharded"):
        with pytest.raises(ValueError, match="unknown method label"):
            parse_method(bad)


def test_method_presets_expand():
    assert DDP_METHODS == ("ddp-dense", "ddp-fp16", "ddp-powersgd-1", "ddp-powersgd-4",
                           "ddp-pactrain-0.5", "ddp-pactrain-0.8", "ddp-pactrain-ternary-0.8")
    args = build_parser().parse_args(["--methods", "dense-fp32,dense-fp16,ddp", "--no-sweep"])
    assert args.methods == ("dense", "fp16") + DDP_METHODS and args.no_sweep  # old spellings
    # Duplicates (a preset member named again) run once, in first-seen order.
    assert expand_methods(["ddp-pactrain-0.8", "ddp", "default"])[:2] == (
        "ddp-pactrain-0.8", "ddp-dense")
    assert len(expand_methods(["ddp", "ddp", "default"])) == 7 + 6
    with pytest.raises(ValueError, match="unknown method label 'ddp-fp32'"):
        expand_methods(["ddp", "ddp-fp32"])


def test_bad_method_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--methods", "dense-fp32,ddp-powersgd-0"])
    assert exc.value.code == 2
    assert "unknown method label 'ddp-powersgd-0'" in capsys.readouterr().err


def test_job_command_lines(monkeypatch, tmp_path):
    """MPI rows under mpirun, DDP rows under torchrun (its workers on the test bed's lo)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # dry runs need no root
    venv = str(Path(PY).parent)
    train = [PY, "-m", "pacmpi.experiments.train", "--dataset", "digits", "--model", "digits_cnn",
             "--width", "32", "--hidden", "1024", "--pretrain-epochs", "1", "--epochs", "8",
             "--batch-size", "32", "--lr", "0.01", "--optimizer", "sgd", "--eval-every", "0",
             "--max-steps", "0", "--seed", "0", "--no-progress", "--json", "out.json",
             "--prune-method", "magnitude", "--pretrained", "pre.pt"]

    def dry(label, rate):
        argv, ranks, options = job_command(FULL, parse_method(label), rate, "pre.pt", "out.json")
        return run_command(argv, ranks, **options, dry_run=True).command

    torchrun = [f"{venv}/torchrun", "--standalone", "--nproc-per-node", "4", "--no-python"]
    assert dry("ddp-powersgd-4", "none") == torchrun + train + [
        "--method", "powersgd", "--ratio", "0.0", "--backend", "ddp", "--powersgd-rank", "4"]
    assert dry("ddp-fp16", "none") == torchrun + train + [
        "--method", "fp16", "--ratio", "0.0", "--backend", "ddp"]
    shaped = dry("ddp-pactrain-ternary-0.8", "100mbit")
    assert shaped[:3] == ["ip", "netns", "exec"] and shaped[3].startswith("pacmpi-")
    ring = ["OMPI_MCA_coll_tuned_use_dynamic_rules=1", "OMPI_MCA_coll_tuned_allreduce_algorithm=4",
            "OMPI_MCA_coll_tuned_allgather_algorithm=4",
            "OMPI_MCA_coll_tuned_allgatherv_algorithm=3",
            "OMPI_MCA_coll_libnbc_iallreduce_algorithm=1"]
    assert shaped[4:] == ["env", *ring, "GLOO_SOCKET_IFNAME=lo", "NCCL_SOCKET_IFNAME=lo", *torchrun,
                          *train, "--method", "pactrain-ternary", "--ratio", "0.8",
                          "--backend", "ddp"]
    mpi = dry("pactrain-0.8", "none")
    assert mpi[0] == f"{venv}/mpirun" and "--oversubscribe" in mpi and "torchrun" not in str(mpi)
    assert mpi[-len(train) - 6:] == train + ["--method", "pactrain", "--ratio", "0.8",
                                             "--topk-ratio", "0.01"]
    # error feedback off and the from-scratch GraSP workload reach the training job
    argv, _, _ = job_command({**FULL, "prune_method": "grasp", "train_args": ["--bias-probe"]},
                             parse_method("pactrain-ternary-0.8-noef"), "none", "p.pt", "o.json")
    assert argv[argv.index("--prune-method") + 1] == "grasp" and "--bias-probe" in argv
    assert argv[argv.index("--method"):] == ["--method", "pactrain-ternary", "--ratio", "0.8",
                                             "--no-error-feedback", "--topk-ratio", "0.01"]
    # the pretrained text workload: no cache to load, AdamW, evaluations every 12 steps
    assert _pretrain(TEXT, tmp_path, 0, 10) is None
    argv, _, _ = job_command(TEXT, parse_method("pactrain-0.8"), "none", None, "o.json")
    assert "--pretrained" not in argv and argv[argv.index("--dataset") + 1] == "codesearch"
    assert argv[argv.index("--optimizer") + 1] == "adamw"
    assert argv[argv.index("--eval-every") + 1] == "12"


def test_compose_timing_places_the_unshaped_curve_at_the_shaped_step_time():
    def point(step, accuracy):
        return {"epoch": 0, "step": step, "wall_seconds": step * 0.1, "train_seconds": step * 0.1,
                "test_accuracy": accuracy, "train_loss": 1.0}

    full = {"curve": [point(12, 0.6), point(24, 0.7)], "final_accuracy": 0.7,
            "best_accuracy": 0.7, "pretrained_accuracy": 0.55}
    unshaped = {"runs": {"dense": full, "fp16": {**full, "curve": [{**point(12, 0.6),
                                                                     "step": None}]}}}

    def timed():
        return {"curve": [], "final_accuracy": None, "best_accuracy": None,
                "throughput": {"step_seconds_mean": 2.5}}

    shaped = {"runs": {"dense": timed(), "fp16": timed(), "topk-1%": timed()}, "failed": {}}
    compose_timing(shaped, unshaped, 8)
    dense = shaped["runs"]["dense"]
    assert [p["wall_seconds"] for p in dense["curve"]] == [30.0, 60.0]
    assert [p["train_seconds"] for p in dense["curve"]] == [30.0, 60.0]
    assert dense["final_accuracy"] == 0.7 and dense["composed"]["step_seconds"] == 2.5
    # no unshaped run, or one evaluated without step numbers: refused, not guessed
    assert sorted(shaped["failed"]) == ["fp16", "topk-1%"] and list(shaped["runs"]) == ["dense"]
    assert full["curve"][0]["wall_seconds"] == pytest.approx(1.2)  # the unshaped run: as it was
    with pytest.raises(ValueError, match="--timing-steps 8 needs .* rates starting with none"):
        main(["--rates", "100mbit", "--timing-steps", "8", "--no-sweep", "--no-plots"])


def test_add_tta_against_ddp_default_and_without_dense_fp32():
    runs = {
        "ddp-dense": {"final_accuracy": 0.98, "curve": _curve([(40, 36, 0.95), (80, 72, 0.98)])},
        "ddp-pactrain-ternary-0.8": {"final_accuracy": 0.97,
                                     "curve": _curve([(5, 4, 0.961), (10, 8, 0.97)])},
    }
    assert add_tta(runs, 0.98) == pytest.approx(0.98 * 0.98)  # the target from ddp-dense
    run = runs["ddp-pactrain-ternary-0.8"]
    assert run["speedup_vs_ddp_dense"] == 16.0 and run["train_speedup_vs_ddp_dense"] == 18.0
    assert run["speedup_vs_dense"] is None  # did not run
    runs["dense"] = {"final_accuracy": 0.5, "curve": _curve([(100, 90, 0.5)])}
    assert add_tta(runs, 0.98) == pytest.approx(0.49)  # dense fp32 sets it when it ran
    assert runs["ddp-dense"]["speedup_vs_dense"] == 100 / 40


def test_help_lists_the_default_methods(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "topk-1%" in capsys.readouterr().out


# --- end to end ----------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_quick_benchmark_writes_json_table_and_plots(tmp_path, cache_dir, capsys):
    out = tmp_path / "results"
    code = main(["--quick", "--methods", "dense-fp32,dense-fp16,pactrain-0.8",
                 "--sweep-ratios", "0,0.8", "--out-dir", str(out),
                 "--cache-dir", str(cache_dir), *TINY])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "== link none (2 ranks) ==" in printed and "accuracy vs pruning ratio" in printed

    report = json.loads((out / "bench_train.json").read_text())
    assert report["config"]["ranks"] == 2 and report["config"]["rates"] == ["none"]
    assert report["notes"] and report["total_seconds"] > 0
    block = report["rates"]["none"]
    assert block["status"] == "ok" and not block["failed"] and block["calibration"] == []
    assert set(block["runs"]) == {"dense", "fp16", "pactrain-0.8"}
    dense = block["runs"]["dense"]
    assert block["target_accuracy"] == pytest.approx(0.98 * dense["final_accuracy"])
    for label, run in block["runs"].items():
        assert len(run["curve"]) == 2
        walls = [p["wall_seconds"] for p in run["curve"]]
        assert walls == sorted(walls) and walls[0] > 0
        assert 0 <= run["final_accuracy"] <= 1
        assert run["throughput"]["ci95_low"] <= run["throughput"]["mean"]
        assert set(run["step_seconds"]) >= {"seconds", "compute", "pack", "comm", "unpack"}
        assert run["bytes_per_step"] > 0 and run["dense_fallbacks"] >= 0
        for base in ("dense", "fp16"):
            base_tta = block["runs"][base.replace("_", "-")]["tta_seconds"]
            expected = (None if base_tta is None or run["tta_seconds"] is None
                        else base_tta / run["tta_seconds"])
            assert run["speedup_vs_" + base] == (pytest.approx(expected) if expected else None)
    # Packing sends what survives pruning (plus unpruned biases and the verification vector).
    packed = block["runs"]["pactrain-0.8"]
    assert packed["density"] == pytest.approx(0.2, abs=0.01)
    assert packed["bytes_per_step"] < 0.35 * dense["bytes_per_step"]
    assert block["runs"]["fp16"]["bytes_per_step"] < 0.55 * dense["bytes_per_step"]

    sweep = report["ratio_sweep"]
    assert [p["ratio"] for p in sweep["points"]] == [0.0, 0.8]
    # Both points reuse the runs above: ratio 0 is the dense run, 0.8 the PacTrain one.
    assert [p["label"] for p in sweep["points"]] == ["dense", "pactrain-0.8"]
    assert sweep["points"][1]["final_accuracy"] == packed["final_accuracy"]

    assert set(report["plots"]) == {"accuracy_vs_time", "tta_speedup", "step_breakdown",
                                    "accuracy_vs_ratio"}
    for path in report["plots"].values():
        data = Path(path).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.timeout(120)
def test_quick_ddp_rows_under_torchrun(tmp_path, cache_dir, capsys):
    """Two DDP rows, unshaped, launched by torchrun; plots named after the JSON."""
    out = tmp_path / "results"
    code = main(["--quick", "--methods", "ddp-dense,ddp-pactrain-ternary-0.8", "--no-sweep",
                 "--out-dir", str(out), "--json", str(out / "bench_train_ddp.json"),
                 "--cache-dir", str(cache_dir), *TINY])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "(98% of ddp dense final)" in printed and " x ddp " in printed
    report = json.loads((out / "bench_train_ddp.json").read_text())
    assert report["config"]["methods"] == ["ddp-dense", "ddp-pactrain-ternary-0.8"]
    assert any(note.startswith("DDP rows") for note in report["notes"])
    block = report["rates"]["none"]
    assert block["status"] == "ok" and not block["failed"] and block["reference"] == "ddp-dense"
    dense, ternary = block["runs"]["ddp-dense"], block["runs"]["ddp-pactrain-ternary-0.8"]
    for run in (dense, ternary):
        assert (run["backend"], run["launcher"]) == ("ddp", "torchrun")
        assert len(run["curve"]) == 2 and 0 <= run["final_accuracy"] <= 1
        assert run["throughput"]["mean"] > 0 and run["link_bytes_per_step"] > 0
    assert block["target_accuracy"] == pytest.approx(0.98 * dense["final_accuracy"])
    assert dense["speedup_vs_ddp_dense"] == 1.0 and dense["speedup_vs_dense"] is None
    assert dense["bytes_per_step"] == dense["dense_bytes_per_step"]
    assert ternary["bytes_per_step"] < 0.1 * dense["bytes_per_step"]
    assert ternary["density"] == pytest.approx(0.2, abs=0.01) and ternary["packed_reductions"] > 0
    assert report["ratio_sweep"] is None
    assert set(report["plots"]) == {"accuracy_vs_time", "tta_speedup", "step_breakdown"}
    for name, path in report["plots"].items():
        assert Path(path) == out / f"bench_train_ddp_{name}.png"
        assert Path(path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- node test bed ------------------------------------------------------------------------

def test_node_jobs_run_mpirun_from_node_0_with_the_dataset(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # dry runs need no root
    cfg = {**FULL, "dataset": "digits32", "model": "resnet18", "nodes": 2, "topology": "star"}
    argv, ranks, options = job_command(cfg, parse_method("pactrain-0.8"), "100mbit", "p.pt",
                                       "o.json")
    assert options == {"link": "100mbit", "oversubscribe": True, "torchrun": False,
                       "nodes": 2, "topology": "star"}
    assert argv[argv.index("--dataset") + 1] == "digits32"
    assert argv[argv.index("--model") + 1] == "resnet18"
    result = run_command(argv, ranks, **options, dry_run=True)
    cmd = result.command
    assert cmd[:3] == ["ip", "netns", "exec"] and cmd[3].endswith("-n0")  # mpirun on node0
    assert "plm_rsh_agent" in cmd and cmd[cmd.index("-n") + 1] == "4"
    assert result.notes[0] == "2 nodes x 2 ranks, star topology at 100.0 Mbit/s per link"
    assert [node["host"] for node in result.nodes] == ["node0", "node1"]
    # without nodes nothing changes: the one shared link
    _, _, plain = job_command(FULL, parse_method("pactrain-0.8"), "100mbit", "p.pt", "o.json")
    assert "nodes" not in plain
    # DDP rows run there too: mpirun starts one torchrun per node
    argv, ranks, options = job_command(cfg, parse_method("ddp-pactrain-0.8-sharded"), "100mbit",
                                       "p.pt", "o.json")
    assert options == {"link": "100mbit", "oversubscribe": False, "torchrun": True,
                       "nodes": 2, "topology": "star"}
    cmd = run_command(argv, ranks, **options, dry_run=True).command
    assert cmd[cmd.index("-n") + 1] == "2" and cmd[cmd.index("--nnodes") + 1] == "2"
    assert cmd[cmd.index("--nproc-per-node") + 1] == "2" and "--sharded" in cmd


@pytest.mark.parametrize("kwargs, message", [
    (dict(nodes=3), "--ranks 4 is not a multiple of --nodes 3"),
    (dict(nodes=1), "--nodes must be an integer >= 2, got 1"),
    (dict(nodes=2, rates=("100mbit", "none")), "rate 'none'"),
    (dict(nodes=2, sweep_rate="none"), "rate 'none'"),
    (dict(nodes=None, topology="star"), "--topology star applies to --nodes K"),
])
def test_node_options_are_refused_with_the_bad_value(kwargs, message):
    args = {"nodes": 2, "topology": None, "ranks": 4, "rates": ("100mbit",), "sweep_rate": None,
            **kwargs}
    with pytest.raises(ValueError, match=message):
        check_nodes(**args)


def test_node_options_reach_the_command_line_errors(capsys):
    for argv, message in [(["--nodes", "3"], "--ranks 4 is not a multiple of --nodes 3"),
                          (["--nodes", "2", "--rates", "none"], "rate 'none'")]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err
    # an unshaped sweep is fine when there is no sweep
    check_nodes(2, "shared", 4, ("100mbit",), None)


def test_table_header_names_nodes_and_topology():
    runs = {"dense": {"final_accuracy": 0.9, "curve": _curve([(1, 1, 0.9)]),
                           "throughput": {"mean": 10.0, "ci95_low": 9.0, "ci95_high": 11.0},
                           "step_seconds": dict.fromkeys(("seconds", "compute", "pack", "comm",
                                                          "unpack"), 0.1),
                           "bytes_per_step": 100, "dense_fallbacks": 0}}
    report = {"config": {"ranks": 4, "nodes": 2, "topology": "star", "target_fraction": 0.98,
                         "seeds": [0]},
              "rates": {"100mbit": {"status": "ok", "calibration": [], "failed": {},
                                    "runs": runs}}}
    derive(report, 0.98)
    assert "== link 100mbit (4 ranks on 2 nodes, star topology) ==" in format_table(report)
    report["config"]["nodes"] = None
    assert "== link 100mbit (4 ranks) ==" in format_table(report)


_SKIP = netns_skip_reason()


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
def test_quick_run_on_two_nodes(tmp_path, cache_dir, capsys):
    """2 nodes x 1 rank at 100 Mbit/s star: every job calibrated per node link, the node
    configuration recorded and printed."""
    out = tmp_path / "results"
    code = main(["--quick", "--rates", "100mbit", "--nodes", "2", "--methods",
                 "dense-fp32,pactrain-ternary-0.8", "--no-sweep", "--no-plots", "--out-dir",
                 str(out), "--cache-dir", str(cache_dir), *TINY[:2], "--epochs", "1",
                 *TINY[4:]])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((out / "bench_train.json").read_text())
    assert report["config"]["nodes"] == 2 and report["config"]["topology"] == "star"
    assert any("Node test bed" in note for note in report["notes"])
    block = report["rates"]["100mbit"]
    assert set(block["runs"]) == {"dense", "pactrain-ternary-0.8"}
    assert len(block["calibration"]) == 2  # one per job
    for calibration in block["calibration"]:
        assert calibration["topology"] == "star" and calibration["n"] == 2
        assert abs(calibration["ratio"] - 1) <= 0.15
    runs = block["runs"]
    assert runs["pactrain-ternary-0.8"]["bytes_per_step"] < runs["dense"]["bytes_per_step"]
    assert "== link 100mbit (2 ranks on 2 nodes, star topology) ==" in printed


# --- calibration refusal -------------------------------------------------------------------


@pytest.mark.mpi
@pytest.mark.timeout(180)
@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
def test_failed_calibration_refuses_the_rate(tmp_path, cache_dir, capsys):
    # Tolerance 0: no measured link is ever exactly nominal, so calibration must refuse.
    out = tmp_path / "results"
    code = main(["--rates", "100mbit", "--methods", "dense-fp32,pactrain-0.8",
                 "--sweep-ratios", "", "--tolerance", "0", "--out-dir", str(out),
                 "--cache-dir", str(cache_dir), *TINY])
    captured = capsys.readouterr()
    assert code == 3
    assert "REFUSED: calibration refused" in captured.out
    assert "no results are reported for this rate" in captured.err
    report = json.loads((out / "bench_train.json").read_text())
    block = report["rates"]["100mbit"]
    assert block["status"] == "refused" and block["runs"] == {}
    assert block["target_accuracy"] is None
    (calibration,) = block["calibration"]  # refused at the first run; nothing else ran
    assert calibration["nominal_bps"] == 100_000_000 and calibration["tolerance"] == 0.0
    assert math.isfinite(calibration["ratio"]) and calibration["ratio"] != 1.0
    assert report["ratio_sweep"] is None and report["plots"] == {}


# --- repeats over seeds --------------------------------------------------------------------

def _seed_runs(points_by_seed):
    """``{seed: {label: (final, [(wall, accuracy), ...])}}`` -> ``seed_runs`` blocks."""
    def run(label, seed, final, points):
        return {"label": label, "seed": seed, "final_accuracy": final, "best_accuracy": final,
                "bytes_per_step": 100.0, "throughput": {"mean": 10.0 + seed},
                "curve": _curve([(w, w, a) for w, a in points])}
    return {str(seed): {"none": {"status": "ok", "error": None, "calibration": [], "failed": {},
                                 "runs": {label: run(label, seed, *value)
                                          for label, value in methods.items()}}}
            for seed, methods in points_by_seed.items()}


def _report(seed_runs):
    return {"config": {"seeds": sorted(map(int, seed_runs)), "methods": ["dense", "pt"],
                       "rates": ["none"], "target_fraction": 0.98, "seed": 0, "ranks": 4,
                       "epochs": 2},
            "seed_runs": seed_runs, "rates": seed_runs[min(seed_runs, key=int)],
            "created": "x"}


def test_repeats_median_range_and_ties_per_seed_targets():
    report = _report(_seed_runs({
        0: {"dense": (0.98, [(40, 0.95), (80, 0.98)]), "pt": (0.97, [(10, 0.97)])},
        1: {"dense": (0.98, [(50, 0.98)]), "pt": (0.97, [(5, 0.90), (30, 0.97)])},
        2: {"dense": (0.99, [(60, 0.99)]), "pt": (0.96, [(20, 0.96)])},  # target 0.9702
    }))
    derive(report, 0.98)
    dense, pt = report["repeats"]["none"]["dense"], report["repeats"]["none"]["pt"]
    assert dense["seeds"] == pt["seeds"] == ["0", "1", "2"]
    assert dense["tta_seconds"] == {"values": [80, 50, 60], "n": 3, "median": 60, "min": 50,
                                    "max": 80}
    # seed 2 never reached its own target: kept in values, out of the statistics
    assert pt["tta_seconds"] == {"values": [10, 30, None], "n": 2, "median": 20, "min": 10,
                                 "max": 30}
    assert pt["reached"] == 2 and dense["reached"] == 3
    assert pt["speedup_vs_dense"]["values"] == [8.0, pytest.approx(50 / 30), None]
    assert pt["final_accuracy"]["median"] == 0.97 and pt["final_accuracy"]["min"] == 0.96
    assert dense["samples_per_second"]["values"] == [10.0, 11.0, 12.0]
    # [10, 30] s against [50, 80] s: no overlap, no tie; accuracy [0.96, 0.97] vs [0.98, 0.99]
    assert pt["tta_ties"] == [] and dense["tta_ties"] == [] and pt["accuracy_ties"] == []
    report["seed_runs"]["1"]["none"]["runs"]["pt"]["curve"] = _curve([(55, 55, 0.97)])
    derive(report, 0.98)
    assert report["repeats"]["none"]["pt"]["tta_ties"] == ["dense"]
    assert report["repeats"]["none"]["dense"]["tta_ties"] == ["pt"]


def test_spread_and_overlap_edges():
    assert spread([None, None]) == {"values": [None, None], "n": 0, "median": None,
                                    "min": None, "max": None}
    assert spread([3.0])["median"] == 3.0
    assert overlap(spread([1, 2]), spread([2, 3])) and not overlap(spread([1, 2]), spread([3]))
    assert not overlap(spread([None]), spread([1]))


def test_merge_joins_seeds_and_refuses_duplicates_and_other_workloads():
    # a: written before one vocabulary (dense was "dense-fp32", with its speedup keys)
    a = _report(_seed_runs({0: {"dense-fp32": (0.98, [(40, 0.98)])}}))
    a["config"]["methods"] = ["dense-fp32", "pt"]
    a["seed_runs"]["0"]["none"]["runs"]["dense-fp32"]["speedup_vs_dense_fp32"] = 1.0
    b = _report(_seed_runs({1: {"dense": (0.97, [(45, 0.97)])}}))
    c = _report(_seed_runs({1: {"pt": (0.96, [(5, 0.96)])}}))
    merged = derive(merge_reports([a, b, c]), 0.98)
    assert merged["config"]["seeds"] == [0, 1] and merged["config"]["methods"] == ["dense", "pt"]
    assert set(merged["seed_runs"]["0"]["none"]["runs"]) == {"dense"}
    assert set(merged["seed_runs"]["1"]["none"]["runs"]) == {"dense", "pt"}
    old_dense = merged["seed_runs"]["0"]["none"]["runs"]["dense"]
    assert old_dense["label"] == "dense" and old_dense["speedup_vs_dense"] == 1.0
    assert "speedup_vs_dense_fp32" not in old_dense
    assert merged["repeats"]["none"]["dense"]["tta_seconds"]["values"] == [40, 45]
    assert merged["repeats"]["none"]["pt"]["seeds"] == ["1"]
    assert "dense-fp32" in a["seed_runs"]["0"]["none"]["runs"]  # the inputs are left as they were
    with pytest.raises(ValueError, match="ran in two reports"):
        merge_reports([a, a])
    with pytest.raises(ValueError, match=r"seed 0, rate none: \['dense'\] ran in two reports"):
        merge_reports([a, _report(_seed_runs({0: {"dense": (0.98, [(40, 0.98)])}}))])
    other = _report(_seed_runs({2: {"dense": (0.98, [(40, 0.98)])}}))
    other["config"]["epochs"] = 5
    with pytest.raises(ValueError, match="workload differs in \\['epochs'\\]"):
        merge_reports([a, other])
    # A report from before --dataset existed ran the digits; it merges with digits, not others.
    old = _report(_seed_runs({3: {"dense": (0.98, [(40, 0.98)])}}))
    old["config"].pop("dataset", None)
    a["config"]["dataset"] = "digits"
    assert merge_reports([a, old])["config"]["seeds"] == [0, 3]
    a["config"]["dataset"] = "digits32"
    with pytest.raises(ValueError, match="workload differs in \\['dataset'\\]"):
        merge_reports([a, old])


def test_merge_command_writes_plots_only_when_asked(tmp_path):
    # two recorded runs of one workload with other methods, as the README merges them
    paths = ",".join(str(REPO / "results" / f"bench_text_curves_{x}.json") for x in "ac")
    merged, plots = tmp_path / "merged.json", tmp_path / "plots"
    args = ["--merge", paths, "--json", str(merged), "--out-dir", str(plots)]
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(args + ["--no-plots"]) == 0
        assert json.loads(merged.read_text())["plots"] == [] and not plots.exists()
        assert main(args) == 0
    names = [p.name for p in plots.iterdir()]
    assert names and all(name.startswith("merged_") for name in names), names


@pytest.fixture(scope="module")
def seeds_run(tmp_path_factory, cache_dir):
    """Seeds 0 and 1 of dense, unshaped: ``(report path, printed table)``. One method: how a
    seed's runs are kept and summarized does not depend on the method (two methods compared:
    test_quick_benchmark_writes_json_table_and_plots)."""
    out = tmp_path_factory.mktemp("seeds")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["--quick", "--methods", "dense-fp32", "--no-sweep", "--seeds",
                     "0,1", "--out-dir", str(out), "--cache-dir", str(cache_dir), *TINY,
                     "--eval-every", "2"])
    assert code == 0, printed.getvalue()
    return out / "bench_train.json", printed.getvalue()


@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_seeds_keep_every_run_and_report_median_and_range(seeds_run):
    path, printed = seeds_run
    report = json.loads(path.read_text())
    assert report["config"]["seeds"] == [0, 1] and set(report["seed_runs"]) == {"0", "1"}
    finals = {}
    for seed, rates in report["seed_runs"].items():
        runs = rates["none"]["runs"]
        assert set(runs) == {"dense"} and runs["dense"]["seed"] == int(seed)
        finals[seed] = runs["dense"]["final_accuracy"]
    row = report["repeats"]["none"]["dense"]
    assert row["final_accuracy"]["values"] == [finals["0"], finals["1"]]
    assert row["final_accuracy"]["median"] == pytest.approx((finals["0"] + finals["1"]) / 2)
    assert row["final_accuracy"]["min"] == min(finals.values())
    assert "median [min, max] over seeds [0, 1]" in printed
    assert "tta_repeats" in report["plots"]


def test_bias_table_separates_error_and_says_whether_error_feedback_matters():
    from pacmpi.experiments.bench_bias import bias_table, format_bias

    def bias(relative, p99):
        return {"median_relative_error": relative, "median_p99_abs_error": p99,
                "median_mean_abs_exact": 0.5, "bias_mean_abs": relative / 10,
                "bias_p99_abs": p99 / 10}
    seed_runs = _seed_runs({s: {"pt-t": (0.95 + s / 100, [(1, 0.9)]),
                                "pt-t-noef": (0.96, [(1, 0.9)]),
                                "lossless": (0.97, [(1, 0.9)])} for s in (0, 1, 2)})
    for seed, rates in seed_runs.items():
        runs = rates["none"]["runs"]
        runs["pt-t"]["bias"] = bias(2.0 + int(seed), 1.0)
        runs["pt-t-noef"]["bias"] = bias(1.0, 0.5)
        runs["lossless"]["bias"] = bias(0.0, 0.0)
    table = bias_table({"seed_runs": seed_runs})
    assert table["pt-t"]["median_relative_error"] == spread([2.0, 3.0, 4.0])
    assert table["pt-t"]["p99_relative_error"]["median"] == 2.0  # 1.0 / 0.5
    assert table["pt-t"]["final_accuracy"]["values"] == [0.95, 0.96, 0.97]
    # [0.95, 0.97] overlaps [0.96, 0.96]: error feedback does not change accuracy (a tie)
    assert table["pt-t"]["ef_changes_accuracy"] is False
    assert table["pt-t-noef"]["ef_changes_accuracy"] is False
    assert "ef_changes_accuracy" not in table["lossless"]
    for runs in (r["none"]["runs"] for r in seed_runs.values()):
        runs["pt-t-noef"]["final_accuracy"] = 0.90  # negative control: clearly apart
    assert bias_table({"seed_runs": seed_runs})["pt-t"]["ef_changes_accuracy"] is True
    assert "no (tie)" in format_bias(table)


@pytest.mark.mpi
@pytest.mark.timeout(240)
@pytest.mark.skipif(_SKIP is not None, reason=str(_SKIP))
def test_curves_from_an_earlier_report_and_timing_on_the_first_seed(seeds_run, tmp_path,
                                                                      cache_dir, capsys):
    """--curves: rate none is read, not run; the shaped rate is timed once (seed 0) and each
    seed's own curve placed at that step time."""
    curves_json, _ = seeds_run
    curves = json.loads(curves_json.read_text())

    def args(seeds="0,1"):
        return ["--quick", "--methods", "dense", "--no-sweep", "--no-plots", "--seeds", seeds,
                "--out-dir", str(tmp_path), "--cache-dir", str(cache_dir), *TINY,
                "--eval-every", "2", "--rates", "none,100mbit", "--timing-steps", "4",
                "--curves", str(curves_json)]

    code = main([*args(), "--json", str(tmp_path / "timed.json")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    report = json.loads((tmp_path / "timed.json").read_text())
    assert report["config"]["curves_from"] == curves["created"]
    step_seconds = set()
    for seed in ("0", "1"):
        assert set(report["seed_runs"][seed]["none"]["runs"]) == {"dense"}  # the asked methods
        unshaped = report["seed_runs"][seed]["none"]["runs"]["dense"]
        source = curves["seed_runs"][seed]["none"]["runs"]["dense"]
        assert unshaped["curve"] == source["curve"]  # read, not run
        assert unshaped["state_sha256"] == source["state_sha256"]
        shaped = report["seed_runs"][seed]["100mbit"]["runs"]["dense"]
        assert shaped["seed"] == 0 and shaped["composed"]["timed_on_seed"] == 0
        seconds = shaped["composed"]["step_seconds"]
        step_seconds.add(seconds)
        assert [p["test_accuracy"] for p in shaped["curve"]] == \
            [p["test_accuracy"] for p in unshaped["curve"]]
        assert [p["wall_seconds"] for p in shaped["curve"]] == \
            pytest.approx([p["step"] * seconds for p in unshaped["curve"]])
    assert len(step_seconds) == 1  # one timing run for both seeds
    # each seed orders its own batches, so the curves (and the composed ones) differ
    assert report["seed_runs"]["0"]["100mbit"]["runs"]["dense"]["curve"] != \
        report["seed_runs"]["1"]["100mbit"]["runs"]["dense"]["curve"]
    # another training, or a seed the report did not run: refused with what differs
    with pytest.raises(ValueError, match=r"training differs in \['lr'\]"):
        main([*args(), "--lr", "0.5"])
    with pytest.raises(ValueError, match=r"no unshaped \(rate none\) runs of seeds \[2\]"):
        main(args("0,2"))
