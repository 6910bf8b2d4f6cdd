"""tc-style rates and sizes, the token bucket's depth, and the constants of a shaped link."""

from __future__ import annotations

import math
import re

#: MTU of loopback (the shaped device in the shared topology).
LO_MTU = 65536
#: The link-layer header tbf counts in every frame.
ETH_HEADER = 14
#: tbf queue limit expressed as time at the rate (as in ``tc ... tbf ... latency 50ms``).
TBF_LATENCY = "50ms"

_RATE_UNITS = {
    "bit": 1,
    "kbit": 10**3,
    "mbit": 10**6,
    "gbit": 10**9,
    "tbit": 10**12,
    "kibit": 2**10,
    "mibit": 2**20,
    "gibit": 2**30,
    "tibit": 2**40,
}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kb": 2**10,
    "m": 2**20,
    "mb": 2**20,
    "g": 2**30,
    "gb": 2**30,
}
_NUMBER = r"(\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"


def parse_rate(s: str) -> int:
    """Bits per second from a tc-style rate: ``10mbit``, ``1gbit``, ``500kbit``, ``200Mbit``.

    Units (case-insensitive): bit, kbit, mbit, gbit, tbit (powers of 1000) and kibit, mibit,
    gibit, tibit (powers of 1024); a bare number is bits/s, as in tc. tc's ``bps`` units mean
    *bytes* per second, a classic trap, so they are refused rather than guessed.
    """
    if not isinstance(s, str):
        raise ValueError(f"rate must be a string like '50mbit', got {s!r}")
    text = s.strip().lower()
    m = re.fullmatch(rf"({_NUMBER})\s*([a-z]*)", text)
    if m is None:
        raise ValueError(f"cannot parse rate {s!r}: expected a number and a unit, like '50mbit'")
    number, unit = m.group(1), m.group(3)
    if unit.endswith("bps"):
        raise ValueError(
            f"rate {s!r}: tc reads '{unit}' as bytes per second; write it in bits, "
            f"e.g. '{number}{unit[:-3]}bit' for {number} {unit[:-3].upper() or ''}bit/s"
        )
    unit = unit or "bit"
    if unit not in _RATE_UNITS:
        raise ValueError(f"rate {s!r}: unknown unit {unit!r}; use one of {', '.join(_RATE_UNITS)}")
    bits = float(number) * _RATE_UNITS[unit]
    if not math.isfinite(bits) or bits < 1:
        raise ValueError(f"rate {s!r} must be at least 1 bit/s")
    return int(round(bits))


def parse_size(s: str | int) -> int:
    """Bytes from a tc-style size: ``64kb`` (= 65536), ``1mb``, ``32k``, ``1500b``, ``1500``."""
    if isinstance(s, bool):
        raise ValueError(f"size must be bytes or a string like '64kb', got {s!r}")
    if isinstance(s, int):
        if s < 1:
            raise ValueError(f"size must be positive, got {s}")
        return s
    if not isinstance(s, str):
        raise ValueError(f"size must be bytes or a string like '64kb', got {s!r}")
    m = re.fullmatch(rf"({_NUMBER})\s*([a-z]*)", s.strip().lower())
    if m is None or m.group(3) not in _SIZE_UNITS:
        raise ValueError(
            f"cannot parse size {s!r}: expected a number with b, kb, mb or gb (bytes), like '64kb'"
        )
    value = float(m.group(1)) * _SIZE_UNITS[m.group(3)]
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"size {s!r} must be at least 1 byte")
    return int(round(value))


def default_burst(rate_bps: int, mtu: int) -> int:
    """Token-bucket depth in bytes: 4 ms at the rate, at least 32 KiB and two full frames.

    tbf drops any packet larger than its bucket that it cannot segment, so the bucket must hold
    the largest frame the device sends. 4 ms of traffic (the classic rate/HZ rule with HZ=250)
    keeps the average rate accurate at high rates despite timer slack.
    """
    return max(rate_bps // 8 // 250, 2 * (mtu + 64), 32 * 1024)
