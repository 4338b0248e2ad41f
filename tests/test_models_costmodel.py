"""Paper-sized models (shape tables, magnitude masks, ``bench allreduce --model``) and the cost
model (formulas, calibration round trip, ``pacmpi model`` commands)."""
import json
import math
import os
import runpy
import subprocess
import sys

import numpy as np
import pytest

from pacmpi.bench.allreduce import run as bench_run
from pacmpi.bench.models import (
    MODELS,
    PUBLISHED_COUNTS,
    Param,
    magnitude_mask,
    model_count,
    model_params,
    random_weights,
)
from pacmpi.buckets import DEFAULT_BUCKET_BYTES
from pacmpi.costmodel import (
    DEFAULT_FIT,
    PEERS,
    calibrate,
    compare,
    peer_step_seconds,
    powersgd_values,
    predict,
    step_seconds,
    tensors,
    validate,
    workload,
)
from pacmpi.methods import ALLREDUCE_METHODS
from pacmpi.model_cli import predict_main
from pacmpi.ternary import TernaryCodec
from pacmpi.units import parse_rate

from mpi_util import mpirun_argv, run_bounded

GBIT = 125e6  # bytes per second


@pytest.mark.parametrize("name", MODELS)
def test_shape_tables_reproduce_the_published_parameter_counts(name):
    assert model_count(name) == PUBLISHED_COUNTS[name]
    names = [p.name for p in model_params(name)]
    assert len(names) == len(set(names))


def test_shape_tables_match_torchvision():
    torchvision = pytest.importorskip("torchvision")
    for name, build in (("resnet50", torchvision.models.resnet50),
                        ("resnet152", torchvision.models.resnet152),
                        ("vgg19", torchvision.models.vgg19)):
        expected = [(n, tuple(p.shape)) for n, p in build(weights=None).named_parameters()]
        assert [(p.name, p.shape) for p in model_params(name)] == expected


def test_magnitude_mask_keeps_exactly_the_largest_values_ties_included():
    params = [Param("a.weight", (10, 10), True), Param("a.bias", (10,), False),
              Param("b.weight", (5, 20), True)]
    # Integer magnitudes: many ties at every threshold.
    weights = np.random.default_rng(3).integers(-4, 5, size=210).astype(np.float32)
    prunable = np.r_[np.ones(100, bool), np.zeros(10, bool), np.ones(100, bool)]
    for density in (1.0, 0.5, 0.37, 0.2, 0.005):
        mask = magnitude_mask(params, weights, density)
        assert mask[~prunable].all()
        kept = mask[prunable]
        assert kept.sum() == round(density * 200)
        magnitude = np.abs(weights[prunable])
        if not kept.all():
            assert magnitude[kept].min() >= magnitude[~kept].max()


def test_magnitude_mask_on_resnet50_is_exact_and_seeded():
    params = model_params("resnet50")
    prunable = sum(p.size for p in params if p.prunable)
    weights = random_weights(params, seed=0)
    assert np.array_equal(weights[:1000], random_weights(params, seed=0)[:1000])
    mask = magnitude_mask(params, weights, 0.2)
    assert mask.sum() == round(0.2 * prunable) + model_count("resnet50") - prunable
    assert workload(model="resnet50", density=0.2)[1] == mask.sum()


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="unknown model 'resnet9'"):
        model_params("resnet9")
    with pytest.raises(ValueError, match="unknown model 'resnet9'"):
        bench_run([], [0.5], ["pactrain"], model="resnet9")
    params = model_params("resnet50")
    for density in (0, 1.5, -0.2):
        with pytest.raises(ValueError, match=rf"density must be in \(0, 1\], got {density}"):
            magnitude_mask(params, np.ones(model_count("resnet50"), np.float32), density)
        with pytest.raises(ValueError, match="density must be in"):
            predict(DEFAULT_FIT, ranks=4, link="1gbit", method="pactrain", model="bert-base",
                    density=density)
    for ranks in (0, -3):
        with pytest.raises(ValueError, match=f"ranks must be an integer >= 1, got {ranks}"):
            predict(DEFAULT_FIT, ranks=ranks, link="1gbit", method="pactrain", nbytes=1 << 20)
    with pytest.raises(ValueError, match="bad link rate 'fast'"):
        parse_rate("fast")
    with pytest.raises(ValueError, match="unknown method 'top-k'"):
        predict(DEFAULT_FIT, ranks=4, link="1gbit", method="top-k", nbytes=1 << 20)
    with pytest.raises(ValueError, match="method 'dense' is not available here"):
        peer_step_seconds(DEFAULT_FIT, method="dense", ranks=4, link_bps=8 * GBIT,
                          shapes=[(10,)], buckets=1)
    with pytest.raises(ValueError, match="powersgd compresses matrices: give a model"):
        predict(DEFAULT_FIT, ranks=4, link="1gbit", method="powersgd", nbytes=1 << 20)
    with pytest.raises(ValueError, match="topk is modelled flat"):
        predict(DEFAULT_FIT, ranks=4, link="1gbit", method="topk", nbytes=1 << 20,
                hierarchical=True)
    with pytest.raises(ValueError, match="topk_ratio must be in \\(0, 1\\], got 0"):
        predict(DEFAULT_FIT, ranks=4, link="1gbit", method="topk", nbytes=1 << 20, topk_ratio=0)
    with pytest.raises(ValueError, match="6 ranks do not fill 4 nodes"):
        predict(DEFAULT_FIT, ranks=6, nodes=4, link="1gbit", method="pactrain", nbytes=1 << 20)


def test_cli_names_an_unknown_model():
    done = subprocess.run([sys.executable, "-m", "pacmpi.cli", "model", "predict", "--ranks", "8",
                           "--link", "1gbit", "--model", "resnet9", "--fit", "none"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "invalid choice: 'resnet9'" in done.stderr
    done = subprocess.run([sys.executable, "-m", "pacmpi.cli", "model", "predict", "--ranks", "0",
                           "--link", "1gbit", "--bytes", "1M", "--fit", "none"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "ranks must be an integer >= 1, got 0" in done.stderr


def test_predict_outside_the_repository_says_it_is_uncalibrated(tmp_path):
    cli = [sys.executable, "-m", "pacmpi.cli", "model", "predict", "--ranks", "8", "--link",
           "1gbit", "--model", "bert-base"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "no results/costmodel_fit.json here, using the uncalibrated model" in done.stderr
    assert "s per step" in done.stdout
    done = subprocess.run(cli + ["--fit", "missing.json"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 2 and "cannot read --fit 'missing.json'" in done.stderr


def test_rates_parse_in_tc_units():
    # The test bed's parser: tc's bit units to bits per second; a bare number is refused.
    assert parse_rate("1gbit") == 8 * GBIT and parse_rate("2.5gbit") == 2.5 * 8 * GBIT
    got = predict(DEFAULT_FIT, ranks=4, link="2.5gbit", method="dense", nbytes=1 << 20)
    assert got["network_s"] == pytest.approx((1 << 20) * 1.5 / (2.5 * GBIT))
    with pytest.raises(ValueError, match="bad link rate '8000'"):
        predict(DEFAULT_FIT, ranks=4, link="8000", method="dense", nbytes=1 << 20)


# Hand-computed cases. 100 MB of float32 = 25e6 values, 4 buckets of 25 MiB; density 0.2:
# 5e6 kept values.
CASE = dict(values=25_000_000, kept=5_000_000, buckets=4)
FIT = dict(DEFAULT_FIT, latency_s=1e-4, intra_Bps=20e9,
           codec_s_per_byte=dict(DEFAULT_FIT["codec_s_per_byte"],
                                 **{"pactrain": [1e-10, 2e-10]}),
           verify_s_per_byte=dict(DEFAULT_FIT["verify_s_per_byte"], pactrain=5e-11))


def test_workload_of_a_byte_count():
    assert workload(nbytes=100_000_000, density=0.2) == (25_000_000, 5_000_000, 4)
    assert math.ceil(1e8 / DEFAULT_BUCKET_BYTES) == 4


def test_ring_factors_star_and_shared():
    star = step_seconds(DEFAULT_FIT, ranks=4, link_bps=8 * GBIT, method="dense", **CASE)
    assert star["network_s"] == pytest.approx(1e8 * 2 * 3 / 4 / GBIT)  # 1.2 s
    shared = step_seconds(DEFAULT_FIT, ranks=4, link_bps=8 * GBIT, method="dense",
                          topology="shared", **CASE)
    assert shared["network_s"] == pytest.approx(1e8 * 2 * 3 / GBIT)  # 4.8 s: 4x the star
    fp16 = step_seconds(DEFAULT_FIT, ranks=4, link_bps=8 * GBIT, method="fp16", **CASE)
    assert fp16["wire_bytes"] == 5e7 and fp16["network_s"] == pytest.approx(0.6)
    single = step_seconds(DEFAULT_FIT, ranks=1, link_bps=8 * GBIT, method="dense", **CASE)
    assert single["seconds"] == 0
    one_node = step_seconds(DEFAULT_FIT, ranks=4, nodes=1, link_bps=8 * GBIT, method="dense",
                            **CASE)
    assert one_node["network_s"] == pytest.approx(1e8 * 1.5 / DEFAULT_FIT["intra_Bps"])


def test_latency_codec_and_verify_terms():
    got = step_seconds(FIT, ranks=4, link_bps=8 * GBIT, method="pactrain", compute_s=0.25, **CASE)
    assert got["wire_bytes"] == 2e7
    assert got["network_s"] == pytest.approx(2e7 * 1.5 / GBIT)           # 0.24 s
    assert got["latency_s"] == pytest.approx(1e-4 * (4 + 1) * 2 * 3)     # 3 ms
    assert got["codec_s"] == pytest.approx(1e8 * 1e-10 + 2e7 * 2e-10)    # 14 ms
    assert got["verify_s"] == pytest.approx(1e8 * 5e-11)                 # 5 ms
    assert got["seconds"] == pytest.approx(0.25 + 0.24 + 0.003 + 0.014 + 0.005)
    # Four ranks on a 2-core host: each rank's codec runs at half speed.
    shared = step_seconds(FIT, ranks=4, link_bps=8 * GBIT, method="pactrain", host_cores=2, **CASE)
    assert shared["codec_s"] == pytest.approx(2 * got["codec_s"])


def test_ternary_bits_grow_with_the_ring_and_hierarchy_uses_nodes():
    flat = step_seconds(DEFAULT_FIT, ranks=8, link_bps=8 * GBIT, method="pactrain-ternary", **CASE)
    words = math.ceil(5e6 / TernaryCodec(8, "uint64").digits_per_word)  # 15 digits
    assert flat["wire_bytes"] == 8 * words
    assert flat["network_s"] == pytest.approx(flat["wire_bytes"] * 2 * 7 / 8 / GBIT)
    # 8 ranks on 2 nodes: base 5 (27 digits per uint64 word), a 2-node ring across the
    # network, and a dense all-reduce among each node's 4 ranks at memory speed.
    hier = step_seconds(FIT, ranks=8, nodes=2, link_bps=8 * GBIT, method="pactrain-ternary",
                        hierarchical=True, **CASE)
    assert TernaryCodec(2, "uint64").digits_per_word == 27
    assert hier["wire_bytes"] == 8 * math.ceil(5e6 / 27) == 1_481_488
    assert hier["network_s"] == pytest.approx(1_481_488 * 1 / GBIT)
    assert hier["intra_s"] == pytest.approx(1e8 * 2 * 3 / 4 / 20e9)      # 7.5 ms
    assert hier["latency_s"] == pytest.approx(1e-4 * 5 * 2 * 1)
    grows = [step_seconds(DEFAULT_FIT, ranks=n, link_bps=8 * GBIT, method="pactrain-ternary",
                          **CASE)["bits_per_value"] for n in (2, 16, 128, 1024)]
    assert grows == sorted(grows) and grows[-1] > 4 * grows[0] / 2


def test_peers_match_hand_computed_values():
    # 4 ranks, one per node, at 1 Gbit/s nominal (a = 0, eta = 1), then with a = 1 ms.
    def peer(method, shapes, fit=DEFAULT_FIT, **kw):
        return peer_step_seconds(fit, method=method, ranks=4, link_bps=8 * GBIT, shapes=shapes,
                                 buckets=1, **kw)

    topk = peer("topk", [(1_000_000,)], topk_ratio=0.01)
    # 10 000 (int64 index, float32 value) pairs; an all-gather puts the other 3 ranks'
    # payloads on every node link.
    assert topk["wire_bytes"] == 120_000 and topk["collective"] == "allgather"
    assert topk["network_s"] == pytest.approx(3 * 120_000 / GBIT)
    # Negative control: a ring all-reduce of the same payload carries 2(P-1)/P = 1.5 of it.
    assert topk["network_s"] != pytest.approx(1.5 * 120_000 / GBIT)
    assert peer("dgc", [(1000,), (10,)], dgc_ratio=0.001)["wire_bytes"] == 24  # 1 per tensor
    terngrad = peer("terngrad", [(1_000_001,), (3,)])
    assert terngrad["wire_bytes"] == 250_001 + 8  # 2-bit codes, 4 per byte; 2 fp32 scales
    shared = peer_step_seconds(DEFAULT_FIT, method="terngrad", ranks=4, link_bps=8 * GBIT,
                               shapes=[(1_000_001,), (3,)], buckets=1, topology="shared")
    assert shared["network_s"] == pytest.approx(4 * 3 * 250_009 / GBIT)  # all through one link
    # PowerSGD rank 4: conv 64x(3*7*7) -> (64 + 147) * 4 = 844 values; a vector whole; 10x10
    # whole, since (10 + 10) * 4 * 2 > 100 (torch's min_compression_rate).
    shapes = [(64, 3, 7, 7), (64,), (10, 10)]
    assert powersgd_values(shapes, 4) == 844 + 64 + 100
    assert powersgd_values(shapes, 1) == (64 + 147) + 64 + (10 + 10)
    slow = dict(DEFAULT_FIT, latency_s=1e-3)
    powersgd = peer("powersgd", shapes, fit=slow, powersgd_rank=4)
    assert powersgd["wire_bytes"] == 4 * 1008 and powersgd["collective"] == "allreduce"
    assert powersgd["network_s"] == pytest.approx(4 * 1008 * 1.5 / GBIT)
    assert powersgd["latency_s"] == pytest.approx(1e-3 * 3 * 2 * 3)  # 3 all-reduces, 6 steps
    assert peer("topk", [(1000,)], fit=slow)["latency_s"] == pytest.approx(1e-3 * 2 * 3)


def test_peer_invariants_bandwidth_and_ranks():
    fit = dict(DEFAULT_FIT, latency_s=1e-4)
    for ranks in (8, 64):
        slower = None
        for link in ("100mbit", "1gbit", "10gbit"):  # every method faster on a faster link
            times = {row["method"]: row["seconds"] for row in
                     compare(fit, ranks=ranks, link=link, model="resnet50", density=0.2)}
            assert set(times) == set(PEERS) | set(ALLREDUCE_METHODS)
            if slower is not None:
                assert all(times[m] < slower[m] for m in times), (link, times, slower)
            slower = times
    # With ranks, an all-gather's bytes per link grow as P - 1; the ring all-reduce's 2(P-1)/P
    # saturates below 2, so the dense step barely grows while TopK's grows 146x.
    def network(method, ranks):
        return predict(DEFAULT_FIT, ranks=ranks, link="1gbit", method=method,
                       model="resnet50")["network_s"]
    for method in PEERS:
        times = [predict(fit, ranks=n, link="1gbit", method=method, model="resnet50")["seconds"]
                 for n in (2, 8, 64, 1024)]
        assert times == sorted(times), method
    assert network("topk", 1024) / network("topk", 8) == pytest.approx(1023 / 7)
    assert network("dense", 1024) / network("dense", 8) == pytest.approx(
        (2 * 1023 / 1024) / (2 * 7 / 8))
    assert network("dense", 1024) / network("dense", 8) < 1.15 < network("topk", 1024) / \
        network("topk", 8)
    assert network("powersgd", 1024) / network("powersgd", 8) < 1.15  # an all-reduce too


def test_predict_compare_names_the_winner_and_the_calibration(capsys):
    argv = ["--ranks", "8", "--link", "1gbit", "--model", "resnet50", "--density", "0.2",
            "--compare"]
    assert predict_main(argv + ["--fit", "none"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("calibration: none (the uncalibrated model")
    rows = [line.split() for line in lines[2:-1]]
    assert sorted(row[0] for row in rows) == sorted(PEERS + ALLREDUCE_METHODS)
    seconds = [float(row[-6]) for row in rows]
    assert seconds == sorted(seconds)
    assert lines[-1].startswith(f"fastest: {rows[0][0]} ")
    fit = os.path.join(os.path.dirname(__file__), "..", "results", "costmodel_fit.json")
    assert predict_main(argv + ["--fit", fit, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["calibration"].startswith(f"calibration: {fit}, fitted on 7 runs")
    assert ("held-out points within 15%: star 15/22 (max 58%), shared 24/24 (max 13%), "
            "star peers (network) 11/26") in doc["calibration"]
    assert [row["seconds"] for row in doc["rows"]] == sorted(row["seconds"] for row in doc["rows"])


def test_speedups_are_ratios_of_step_times():
    got = predict(FIT, ranks=16, nodes=2, link="10gbit", method="pactrain", model="resnet152",
                  density=0.5, compute_s=0.1)
    assert got["speedup_vs_dense"] == pytest.approx(got["dense_s"] / got["seconds"])
    assert got["speedup_vs_fp16"] == pytest.approx(got["fp16_s"] / got["seconds"])
    assert got["values"] == PUBLISHED_COUNTS["resnet152"]


TRUE_FIT = dict(DEFAULT_FIT, latency_s={"shared": 3e-4, "star": 2e-3},
                link_efficiency={"shared": 0.93, "star": 0.85},
                host_cores=2,
                codec_s_per_byte={"dense": [0.0, 0.0], "fp16": [4e-10, 0.0],
                                  "pactrain": [3e-10, 5e-10], "pactrain-ternary": [2e-10, 3e-9]},
                verify_s_per_byte={"dense": 0.0, "fp16": 0.0, "pactrain": 6e-10,
                                   "pactrain-ternary": 9e-10})


def _synthetic_documents(fit, setups):
    """Benchmark JSON as `pacmpi bench allreduce --model --link --json` writes it (or, where
    the model is a number of bytes, `--sizes`: one bucket, its rows saying what they reduced),
    with the times the model itself predicts."""
    documents = []
    for model, ranks, link, *topology in setups:
        topology = topology[0] if topology else "shared"
        rows = []
        for density in (0.5, 0.2):
            if isinstance(model, int):
                values, buckets = model // 4, 1
                kept = round(density * values)
            else:
                values, kept, buckets = workload(model=model, density=density)
            for method in ALLREDUCE_METHODS:
                if method in ("dense", "fp16") and density != 0.5:
                    continue
                got = step_seconds(fit, ranks=ranks, link_bps=parse_rate(link), values=values,
                                   kept=kept, buckets=buckets, method=method,
                                   topology=topology, host_cores=fit["host_cores"])
                rows.append({"method": method, "density": density, "count": values,
                             "kept": kept, "buckets": buckets,
                             "time_avg_us": got["seconds"] * 1e6,
                             "pack_unpack_us": got["codec_s"] * 1e6,
                             "verify_us": got["verify_s"] * 1e6,
                             "wire_bytes_per_rank": got["wire_bytes"]})
        documents.append({"ranks": ranks, "model": None if isinstance(model, int) else model,
                          "link": link, "topology": topology,
                          "nodes": ranks, "rows": rows, "allreduce_algorithm": "ring",
                          "source": f"{model}_{ranks}_{link}_{topology}"})
    return documents


def test_calibrate_recovers_the_parameters_of_synthetic_runs():
    documents = _synthetic_documents(TRUE_FIT, [("resnet50", 2, "1gbit"),
                                                ("resnet50", 4, "100mbit"),
                                                ("bert-base", 2, "100mbit"),
                                                ("resnet50", 4, "1gbit", "star")])
    fit = calibrate(documents, host_cores=2)
    # One a and one eta per topology: the star's are not the shared bed's.
    assert fit["latency_s"] == pytest.approx(TRUE_FIT["latency_s"], rel=1e-6)
    assert fit["link_efficiency"] == pytest.approx(TRUE_FIT["link_efficiency"], rel=1e-6)
    for method in ALLREDUCE_METHODS:
        assert fit["codec_s_per_byte"][method] == pytest.approx(
            TRUE_FIT["codec_s_per_byte"][method], rel=1e-6, abs=1e-18)
        assert fit["verify_s_per_byte"][method] == pytest.approx(
            TRUE_FIT["verify_s_per_byte"][method], rel=1e-6, abs=1e-18)
    assert max(abs(p["error"]) for p in fit["points"]) < 1e-9
    # Benchmark files and fits written before one vocabulary name dense "dense-fp32" and fp16
    # "dense-fp16": they fit and predict the same.
    old = json.loads(json.dumps(documents).replace('"dense"', '"dense-fp32"')
                     .replace('"fp16"', '"dense-fp16"'))
    assert {row["method"] for row in old[0]["rows"]} >= {"dense-fp32", "dense-fp16"}
    assert calibrate(old, host_cores=2)["codec_s_per_byte"] == fit["codec_s_per_byte"]
    old_fit = json.loads(json.dumps(fit).replace('"dense"', '"dense-fp32"')
                         .replace('"fp16"', '"dense-fp16"'))
    assert "dense-fp16" in old_fit["codec_s_per_byte"]
    assert validate(old_fit, documents) == validate(fit, documents)
    held_out = validate(fit, _synthetic_documents(TRUE_FIT, [("gpt2-124m", 4, "1gbit"),
                                                             ("vgg19", 2, "10gbit", "star")]))
    assert len(held_out) == 12 and max(abs(p["error"]) for p in held_out) < 1e-9
    # `--sizes` runs (no model; each row its own bucket count and survivors) fit and predict
    # the same way: the star's parameters from sized runs alone, a held-out size and rate.
    sized = calibrate(_synthetic_documents(TRUE_FIT, [(8 << 20, 2, "100mbit", "star"),
                                                      (32 << 20, 4, "1gbit", "star")]),
                      host_cores=2)
    assert sized["latency_s"]["star"] == pytest.approx(TRUE_FIT["latency_s"]["star"], rel=1e-6)
    assert sized["link_efficiency"]["star"] == pytest.approx(
        TRUE_FIT["link_efficiency"]["star"], rel=1e-6)
    unseen = validate(sized, _synthetic_documents(TRUE_FIT, [(32 << 20, 3, "300mbit", "star")]))
    assert len(unseen) == 6 and max(abs(p["error"]) for p in unseen) < 1e-9
    # TopK's rows are not fitted but predicted: its network and latency against the measured
    # step less its codec (which the model leaves out).
    values, codec = (32 << 20) // 4, 0.25
    peer = peer_step_seconds(TRUE_FIT, method="topk", ranks=3, link_bps=parse_rate("300mbit"),
                             shapes=[(values,)], buckets=1, topology="star")
    unseen_doc = _synthetic_documents(TRUE_FIT, [(32 << 20, 3, "300mbit", "star")])[0]
    topk = dict(unseen_doc, rows=[{
        "method": "topk", "density": 0.01, "count": values, "kept": math.ceil(0.01 * values),
        "buckets": 1, "time_avg_us": (peer["seconds"] + codec) * 1e6,
        "pack_unpack_us": codec * 1e6, "verify_us": 0.0,
        "wire_bytes_per_rank": peer["wire_bytes"]}])
    (row,) = validate(sized, [topk])
    assert row["compared"] == "network" and abs(row["error"]) < 1e-9
    assert calibrate([topk, unseen_doc], host_cores=2)["points"] == calibrate(
        [unseen_doc], host_cores=2)["points"]
    # DGC's ratio is its row's density and PowerSGD's rank the run's, as bench allreduce
    # records them: a held-out row at other knobs than the defaults is predicted at its own.
    shapes = tensors(model="resnet50")[0]
    for method, density, knobs in [("dgc", 0.01, {"dgc_ratio": 0.01}),
                                   ("powersgd", 0.5, {"powersgd_rank": 1})]:
        buckets = workload(model="resnet50", density=density)[2]
        times = [peer_step_seconds(TRUE_FIT, method=method, ranks=3, shapes=shapes,
                                   link_bps=parse_rate("300mbit"), buckets=buckets,
                                   topology="star", **chosen) for chosen in (knobs, {})]
        assert times[0]["wire_bytes"] != times[1]["wire_bytes"], method  # the knob matters
        doc = dict(unseen_doc, model="resnet50", **knobs, rows=[{
            "method": method, "density": density, "count": 0, "kept": 0, "buckets": buckets,
            "time_avg_us": (times[0]["seconds"] + codec) * 1e6, "pack_unpack_us": codec * 1e6,
            "verify_us": 0.0, "wire_bytes_per_rank": times[0]["wire_bytes"]}])
        (row,) = validate(sized, [doc])
        assert abs(row["error"]) < 1e-9, (method, row["error"])
    # Negative control: the same runs claiming twice the survivors are predicted slower.
    doubled = _synthetic_documents(TRUE_FIT, [(32 << 20, 3, "300mbit", "star")])
    for row in doubled[0]["rows"]:
        row["kept"] *= 2
    assert any(p["error"] > 0.05 for p in validate(sized, doubled))
    default_choice = dict(documents[3], allreduce_algorithm="default")
    with pytest.raises(ValueError, match="star run with all-reduce algorithm 'default'"):
        calibrate([default_choice], host_cores=2)
    shared_only = calibrate(documents[:1], host_cores=2)
    with pytest.raises(ValueError, match="no link_efficiency for topology 'star'"):
        validate(shared_only, documents[3:])


def test_calibrate_and_predict_commands_round_trip(tmp_path):
    documents = _synthetic_documents(TRUE_FIT, [("resnet50", 2, "1gbit", "star"),
                                                ("resnet50", 4, "100mbit", "star")])
    paths = []
    for doc in documents:
        paths.append(tmp_path / f"{doc.pop('source')}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / "fit.json"
    cli = [sys.executable, "-m", "pacmpi.cli", "model"]
    done = subprocess.run(cli + ["calibrate", "--json", str(paths[0]), "--validate",
                                 str(paths[1]), "--host-cores", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6/6 within 15%" in done.stdout
    fit = json.loads(out.read_text())
    done = subprocess.run(cli + ["predict", "--ranks", "64", "--nodes", "8", "--link", "10gbit",
                                 "--model", "bert-base", "--density", "0.2", "--method",
                                 "pactrain-ternary", "--hierarchical", "--compute-s", "0.2",
                                 "--fit", str(out), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = predict(fit, ranks=64, nodes=8, link="10gbit", model="bert-base", density=0.2,
                       method="pactrain-ternary", hierarchical=True, compute_s=0.2)
    got = json.loads(done.stdout)
    assert got.pop("calibration").startswith(f"calibration: {out}, fitted on ")
    assert got == pytest.approx(expected)


def test_bench_allreduce_model_sends_what_the_cost_model_counts(tmp_path):
    out = tmp_path / "bench.json"
    argv = mpirun_argv(2) + [sys.executable, "-m", "pacmpi.cli", "bench", "allreduce",
                             "--model", "resnet50", "--densities", "0.2",
                             "--methods", "dense-fp32,dense-fp16,pactrain,pactrain-ternary",
                             "--iters", "1", "--warmup", "0", "--link", "1gbit",
                             "--json", str(out)]
    done = run_bounded(argv, timeout=240, what="bench allreduce --model resnet50",
                       env=dict(os.environ, OMPI_MCA_rmaps_base_oversubscribe="1",
                                OMPI_MCA_coll_tuned_use_dynamic_rules="1",
                                OMPI_MCA_coll_tuned_allreduce_algorithm="4"))  # pacmpi-run's pin
    assert done.returncode == 0, done.stdout + done.stderr
    doc = json.loads(out.read_text())
    assert (doc["model"], doc["link"], doc["ranks"]) == ("resnet50", "1gbit", 2)
    assert doc["allreduce_algorithm"] == "ring"  # as Open MPI read it back: what the ranks ran
    values, kept, buckets = workload(model="resnet50", density=0.2)
    for row in doc["rows"]:
        assert row["wrong"] == 0 and row["buckets"] == buckets and row["count"] == values
        expected = step_seconds(DEFAULT_FIT, ranks=2, link_bps=8 * GBIT, values=values, kept=kept,
                                buckets=buckets, method=row["method"])["wire_bytes"]
        # Ternary: the model leaves out each bucket's partial last word and, on this first
        # step, the scales' own all-reduce (16 bytes per bucket); with a scale per tensor,
        # each tensor's codes start on a word (at most one word of padding) and its scale is
        # an int64 in the scales' all-reduce and in the verification vector.
        tensors = len(model_params("resnet50"))
        slack = 24 * buckets + 24 * tensors if row["method"] == "pactrain-ternary" else 0
        assert 0 <= row["wire_bytes_per_rank"] - expected <= slack, row["method"]


def test_the_contenders_table_picks_the_shortest_step():
    """scripts/plot_costmodel.py's table of every method: PacTrain's cell is the faster of
    flat and hierarchical, the winner the shortest step, TopK's all-gather grows with ranks."""
    script = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "scripts",
                                         "plot_costmodel.py"))
    fit = dict(DEFAULT_FIT, latency_s=25e-6, link_efficiency=0.94)
    table = script["contenders"](fit, {"resnet50": 0.1}, 4, False)
    assert len(table) == 12
    for row in table:
        assert row["fastest"] == min(row["seconds"], key=row["seconds"].get)
        common = dict(ranks=row["ranks"], nodes=row["ranks"] // 4, link=row["link"],
                      model="resnet50", compute_s=0.1, codec=False, density=0.2)
        assert row["seconds"]["PacTrain 0.2"] == min(
            predict(fit, method="pactrain", **common)["seconds"],
            predict(fit, method="pactrain", hierarchical=True, **common)["seconds"])
    topk = {(r["ranks"], r["link"]): r["seconds"]["TopK 1%"] for r in table}
    assert topk[(8, "1gbit")] < topk[(64, "1gbit")] < topk[(1024, "1gbit")]
