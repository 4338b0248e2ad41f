"""Link rates and byte sizes as people type them: one parser each, one unit each.

Rates are tc's: a number and a decimal bit unit (``100mbit``, ``1gbit``, ``2.5gbit``), parsed
to bits per second. A bare number and byte units (``100mbps``) are refused on purpose: tc
reads ``mbps`` as megaBYTES per second, a factor-8 trap, and a bare number hides which unit
was meant. Sizes are binary (``64M`` = 64 MiB), parsed to bytes.
"""
import re

__all__ = ["parse_rate", "format_rate", "parse_size"]

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_rate(text):
    """``"100mbit"`` -> ``100000000`` bits per second (int); ``ValueError`` names the bad
    value (units: bit, kbit, mbit, gbit, tbit; decimal, as in tc)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", str(text).lower())
    if not match or match.group(2) not in _RATE_UNITS:
        raise ValueError(
            f"bad link rate {text!r}: expected a number and one of the units "
            f"{', '.join(_RATE_UNITS)} (e.g. 100mbit, 1gbit); byte units like 'mbps' and "
            f"bare numbers are not accepted")
    bps = int(float(match.group(1)) * _RATE_UNITS[match.group(2)])
    if bps <= 0:
        raise ValueError(f"bad link rate {text!r}: must be above zero")
    return bps


def format_rate(bps):
    """``100000000`` (bits per second) -> ``"100.0 Mbit/s"``."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.1f} {unit}"
    return f"{bps:.0f} bit/s"


def parse_size(text):
    """``"64M"`` -> 67108864 bytes (``K``, ``M``, ``G`` binary; ``64MiB`` and ``64MB`` read
    the same); ``ValueError`` names the bad value."""
    number = str(text).strip().upper().removesuffix("B").removesuffix("I")
    unit = number[-1] if number and number[-1] in _SIZE_UNITS else ""
    try:
        value = int(float(number[:-1] if unit else number) * _SIZE_UNITS[unit])
    except ValueError:
        raise ValueError(f"bad size {text!r}: use e.g. 1M, 64M, 1G") from None
    if value < 4:
        raise ValueError(f"bad size {text!r}: at least 4 bytes")
    return value
