"""The codec microbenchmark's traffic model and dtypes, and the GPU check's summary of it."""
import importlib.util
import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pacmpi import kernels
from pacmpi.bench import codec
from pacmpi.ternary import TernaryCodec

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.mark.parametrize("dtype, itemsize", [("float32", 4), ("bfloat16", 2), ("float64", 8)])
def test_bytes_moved_counts_values_indices_residuals_words_and_zeroing(dtype, itemsize):
    size, codec4 = 1000, TernaryCodec(4, "uint64")
    dense = codec._Bucket(size, 1.0, codec4, dtype=np.dtype(dtype) if dtype != "bfloat16"
                          else codec.check_float_dtype(dtype))
    packed = codec._Bucket(size, 0.5, codec4, dtype=dense.flat.dtype)
    residual = 8 if dtype == "float64" else 4
    words = codec4.words_for(packed.count) * 8
    assert codec.bytes_moved("copyto", dense) == 2 * size * itemsize
    assert codec.bytes_moved("scatter", dense) == 2 * size * itemsize  # in place, no zeroing
    assert codec.bytes_moved("gather", packed) == packed.count * (2 * itemsize + 8)
    assert codec.bytes_moved("scatter", packed) == packed.count * (2 * itemsize + 8) + \
        size * itemsize
    assert codec.bytes_moved("ternary_encode", packed) == \
        packed.count * (itemsize + 8 + 2 * residual) + words
    assert codec.bytes_moved("ternary_decode", packed) == \
        words + packed.count * (8 + itemsize) + size * itemsize
    # The in-place pair reads the mask's bits, no indices.
    assert codec.bytes_moved("compact", packed) == 2 * packed.count * itemsize + size // 8
    assert codec.bytes_moved("expand", packed) == (packed.count + size) * itemsize + size // 8
    assert dense.call("compact") is None and packed.call("compact") is not None
    # Scales through the bits read every coordinate, the bits and the survivors' residual.
    assert codec.bytes_moved("absmax_bits", packed) == \
        size * itemsize + packed.count * residual + size // 8
    assert dense.call("absmax_bits") is None
    packed.call("absmax_bits")()
    assert packed.top[0] == kernels.absmax(np, packed.flat, packed.indices, packed.residual)


def test_bfloat16_run_reports_each_op_against_copyto(tmp_path):
    pytest.importorskip("numba")
    out = tmp_path / "codec_bfloat16.json"
    assert codec.main(["--size", "4K", "--repeat", "1", "--dtype", "bfloat16",
                       "--no-reference", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["dtype"] == "bfloat16"
    assert report["config"]["dense_bytes"] == 4096 * 2
    copies = [r for r in report["rows"] if r["op"] == "copyto"]
    assert [r["of_copy_bandwidth"] for r in copies] == [1.0, 1.0]
    assert all(r["of_copy_bandwidth"] > 0 for r in report["rows"])

    (tmp_path / "steps.tsv").write_text("tests\tok\t12\ncodec_bfloat16\tfailed(1)\t3\n")
    summary = subprocess.run([sys.executable, str(SCRIPTS / "gpu_summary.py"), str(tmp_path)],
                             capture_output=True, text=True, check=True).stdout
    assert f"{'codec_bfloat16':<28}failed(1)" in summary
    rows = runpy.run_path(str(SCRIPTS / "gpu_summary.py"))["bandwidth_rows"](report)
    assert {(what, density) for what, density, _, _ in rows} == {
        ("unpack (scatter)", 1.0), ("ternary encode+decode", 1.0), ("pack (gather)", 0.5),
        ("unpack (scatter)", 0.5), ("ternary encode+decode", 0.5)}
    for what, density, share, goal in rows:
        assert f"{what:<24} density {density:<4} {share:>5.0%}" in summary


def test_unsupported_dtype_is_named():
    with pytest.raises(TypeError, match="gradient dtype int8 is not supported"):
        codec.run(size=8, dtype="int8")
    with pytest.raises(TypeError, match="'float8' is not supported"):
        codec.run(size=8, dtype="float8")


def test_gpu_check_refuses_to_start_without_a_gpu(tmp_path):
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here: the script would run its checks")
    result = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh"), str(tmp_path), sys.executable],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert "CuPy cannot see a GPU: nothing to check" in result.stdout
