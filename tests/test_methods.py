"""The one table of method names (``pacmpi.methods``) and what reads it."""
import pytest

from pacmpi import QUANTIZE_MODES
from pacmpi.methods import ALLREDUCE_METHODS, METHODS, canonical_name, lookup_method


def test_every_method_maps_to_an_engine_mode_and_a_collective():
    assert tuple(METHODS) == ("dense", "fp16", "pactrain", "pactrain-ternary", "topk",
                              "terngrad", "dgc", "powersgd")
    for name, method in METHODS.items():
        assert method.name == name and method.quantize in QUANTIZE_MODES
        assert method.collective in ("allreduce", "allgather", "powersgd")
        # Only the engine's all-reduces pack or quantize; lossless ones neither quantize.
        assert method.collective == "allreduce" or not (method.packed or method.quantize)
        assert not (method.lossless and method.quantize)
    assert ALLREDUCE_METHODS == ("dense", "fp16", "pactrain", "pactrain-ternary")
    assert [m for m in METHODS if METHODS[m].packed] == ["pactrain", "pactrain-ternary"]


def test_old_spellings_are_aliases():
    assert lookup_method("dense-fp32") is METHODS["dense"]
    assert lookup_method("dense-fp16", ALLREDUCE_METHODS) is METHODS["fp16"]
    assert canonical_name("dense-fp16") == "fp16" and canonical_name("topk-1%") == "topk-1%"


@pytest.mark.parametrize("name, among, message", [
    ("int8", None, "unknown method 'int8'; choose from dense, fp16, pactrain, "
                   "pactrain-ternary, topk, terngrad, dgc, powersgd"),
    ("topk", ALLREDUCE_METHODS, "method 'topk' is not available here; choose from dense, fp16, "
                                "pactrain, pactrain-ternary"),
    ("dense-fp8", ("dense",), "unknown method 'dense-fp8'; choose from dense"),
    (["dense"], None, "unknown method \\['dense'\\]"),
])
def test_a_bad_name_is_named_with_the_choices(name, among, message):
    with pytest.raises(ValueError, match=message):
        lookup_method(name, among)
