import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pacmpi.hashing import mask_fingerprint, uniform
from pacmpi.ternary import TernaryCodec, stochastic_ternary, ternary_key, wire_bits_table

from xp_util import ARRAY_MODULES, asnumpy


@settings(max_examples=80, deadline=None)
@given(length=st.integers(1, 3000), seed=st.integers(0, 2**32 - 1), flip=st.integers(0, 10**9))
def test_fingerprint_sees_every_single_bit_flip(length, seed, flip):
    mask = np.random.default_rng(seed).random(length) < 0.5
    other = mask.copy()
    other[flip % length] ^= True
    assert mask_fingerprint(np, mask) == mask_fingerprint(np, mask.copy())
    assert mask_fingerprint(np, mask) != mask_fingerprint(np, other)


def test_fingerprint_depends_on_length_and_position():
    assert mask_fingerprint(np, np.zeros(31, bool)) != mask_fingerprint(np, np.zeros(32, bool))
    a = np.zeros(100, bool)
    a[:10] = True
    b = np.roll(a, 1)
    assert a.sum() == b.sum() and mask_fingerprint(np, a) != mask_fingerprint(np, b)


@pytest.mark.parametrize("xp", ARRAY_MODULES)
def test_numpy_and_array_module_agree_bit_for_bit(xp):
    mask = np.random.default_rng(1).random(10007) < 0.3
    assert mask_fingerprint(xp, xp.asarray(mask)) == mask_fingerprint(np, mask)
    np.testing.assert_array_equal(asnumpy(uniform(xp, 5000, 99)), uniform(np, 5000, 99))
    values = np.random.default_rng(2).standard_normal(4096).astype(np.float32)
    codes = stochastic_ternary(xp, xp.asarray(values), 3.5, 7)
    np.testing.assert_array_equal(asnumpy(codes), stochastic_ternary(np, values, 3.5, 7))
    codec = TernaryCodec(4)
    words = codec.encode(xp, codes)
    np.testing.assert_array_equal(asnumpy(words), codec.encode(np, asnumpy(codes)))
    np.testing.assert_array_equal(asnumpy(codec.decode(xp, words * 4, codes.size)),
                                  4 * asnumpy(codes).astype(np.int32))


@pytest.mark.parametrize("xp", ARRAY_MODULES)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7, 8, 16, 64])
@pytest.mark.parametrize("word_dtype", ["int64", "int32"])
def test_word_sums_decode_to_exact_code_sums(xp, ranks, word_dtype):
    codec = TernaryCodec(ranks, word_dtype)
    rng = np.random.default_rng(ranks)
    count = 3 * codec.digits_per_word + 5  # a partial last word
    codes = [rng.integers(-1, 2, size=count).astype(np.int8) for _ in range(ranks)]
    total = sum(codec.encode(xp, xp.asarray(c)) for c in codes)
    expected = np.sum([c.astype(np.int32) for c in codes], axis=0)
    np.testing.assert_array_equal(asnumpy(codec.decode(xp, total, count)), expected)


@settings(max_examples=200, deadline=None)
@given(word_dtype=st.sampled_from(["int64", "int32"]), data=st.data())
def test_lane_sums_never_carry_up_to_the_supported_maximum(word_dtype, data):
    """Any mix of +1/0/-1 over up to max_world_size ranks decodes exactly.

    Encoding is linear, so n ranks' summed words equal counts times the words of constant
    codes; that reaches rank counts no test could launch.
    """
    ranks = data.draw(st.integers(1, TernaryCodec.max_world_size(word_dtype)))
    codec = TernaryCodec(ranks, word_dtype)
    count = codec.digits_per_word
    plus = data.draw(st.lists(st.integers(0, ranks), min_size=count, max_size=count))
    minus = [data.draw(st.integers(0, ranks - p)) for p in plus]
    words = np.zeros(1, dtype=codec.word_dtype)
    for j in range(count - 1, -1, -1):  # digit j holds sum of (code + 1) = 2*plus + zeros
        words = words * codec.base + (2 * plus[j] + (ranks - plus[j] - minus[j]))
    np.testing.assert_array_equal(codec.decode(np, words, count),
                                  np.array(plus) - np.array(minus))


def test_codec_rejects_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be a positive integer, got 0"):
        TernaryCodec(0)
    with pytest.raises(ValueError, match="word_dtype must be one of .* got 'int8'"):
        TernaryCodec(2, "int8")
    too_many = TernaryCodec.max_world_size("int32") + 1
    with pytest.raises(ValueError, match=f"at most {too_many - 1} ranks are supported"):
        TernaryCodec(too_many, "int32")


def test_wire_bits_are_within_a_fraction_of_a_bit_of_the_bound():
    for row in wire_bits_table((2, 4, 8, 16, 64)):
        assert row["log2_2n_plus_1"] <= row["bits_per_value"] < row["log2_2n_plus_1"] + 1
        assert row["log2_2n_plus_1"] == math.log2(2 * row["ranks"] + 1)


@pytest.mark.parametrize("xp", ARRAY_MODULES)
def test_stochastic_ternary_is_unbiased(xp):
    values = np.linspace(-2.0, 2.0, 201).astype(np.float32)
    scale, trials = 2.0, 4000
    total = np.zeros(values.size)
    for seed in range(trials):
        total += asnumpy(stochastic_ternary(xp, xp.asarray(values), scale,
                                            ternary_key(0, seed, 0, 0)))
    mean = total * scale / trials
    # Per value: variance of scale*q is scale*|v| - v^2 <= 1, so 5 sigma over 4000 trials.
    assert np.max(np.abs(mean - values)) < 5 * 1.0 / math.sqrt(trials)
    signs = asnumpy(stochastic_ternary(xp, xp.asarray(values), scale, 1))
    assert set(np.unique(signs)) <= {-1, 0, 1}


def test_stochastic_ternary_negative_control_detects_bias():
    """The unbiasedness check above can fail: deterministic rounding is biased."""
    values = np.linspace(-2.0, 2.0, 201)
    biased = np.rint(values / 2.0) * 2.0
    assert np.max(np.abs(biased - values)) > 5 * 1.0 / math.sqrt(4000)


def test_uint64_words_are_within_one_and_a_half_percent_of_the_bound():
    from pacmpi.ternary import format_wire_bits
    for ranks, digits in ((4, 20), (64, 9)):
        codec = TernaryCodec(ranks, "uint64")
        assert codec.digits_per_word == digits
        assert codec.bits_per_value <= 1.015 * math.log2(2 * ranks + 1)
        assert TernaryCodec(ranks, "int64").bits_per_value > codec.bits_per_value
    table = format_wire_bits((4, 64)).splitlines()
    assert "3.368 (19)" in table[1] and "3.200 (20)" in table[1] and "3.170" in table[1]
    assert "7.111 ( 9)" in table[2]
