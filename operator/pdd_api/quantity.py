"""Kubernetes resource quantities as the API server reads them (apimachinery's ParseQuantity), so
a rule that compares a memory limit in `pdd validate` reaches the verdict of the same rule in
CEL (the Kubernetes quantity library: `isQuantity`, `quantity(...).asApproximateFloat()`), down
to the float rounding at a boundary.

A quantity is held as Go holds it, an integer times a power of ten (`unscaled`, `scale`:
value = unscaled * 10**-scale), because asApproximateFloat's result depends on that form.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction

_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUFFIX_CHARS = frozenset("eEinumkKMGTP")
_DIGITS = frozenset("0123456789")
_NANO = 9  # the finest scale ParseQuantity keeps (it rounds up to it)
_MAX_INT64 = 2**63 - 1
MAX_BYTES = _MAX_INT64  # the most Kubernetes counts of a resource
_MAX_INT64_FACTORS = 18
# Powers of ten past a double's range all read as +Inf (Go's Pow10 is +Inf beyond 308): a
# larger exponent is held at this one, so `1e2000000000` costs nothing to hold.
_BEYOND_DOUBLE = 400
GIB = 2**30


@dataclass(frozen=True)
class Quantity:
    unscaled: int
    scale: int

    @property
    def exact(self) -> Fraction:
        """The value (an absurd exponent held at _BEYOND_DOUBLE)."""
        return Fraction(self.unscaled) / Fraction(10) ** self.scale

    def approximate_float(self) -> float:
        """Go's Quantity.AsApproximateFloat64: the unscaled integer as a float times Pow10."""
        try:
            base = float(self.unscaled)
        except OverflowError:
            base = math.inf if self.unscaled > 0 else -math.inf
        return base if self.scale == 0 else base * _pow10(-self.scale)


_POW10 = [float(f"1e{i}") for i in range(32)]
_POS32 = [1e0, 1e32, 1e64, 1e96, 1e128, 1e160, 1e192, 1e224, 1e256, 1e288]
_NEG32 = [1e-0, 1e-32, 1e-64, 1e-96, 1e-128, 1e-160, 1e-192, 1e-224, 1e-256, 1e-288, 1e-320]


def _pow10(n: int) -> float:
    """Go's math.Pow10, table for table (its products are not always the nearest double)."""
    if 0 <= n <= 308:
        return _POS32[n // 32] * _POW10[n % 32]
    if -323 <= n <= 0:
        return _NEG32[-n // 32] / _POW10[-n % 32]
    return math.inf if n > 0 else 0.0


def _split(text: str) -> tuple[bool, str, str, str, str] | None:
    """apimachinery's parseQuantityString: (positive, value, num, denom, suffix)."""
    positive, pos, end = True, 0, len(text)
    if pos < end and text[0] in "+-":
        positive = text[0] == "+"
        pos += 1
    while pos < end and text[pos] == "0":
        pos += 1
    if pos >= end:
        return positive, "0", "0", "", ""
    start = pos
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    num = text[start:pos] or "0"
    if pos >= end:
        return positive, text, num, "", ""
    denom = ""
    if text[pos] == ".":
        pos += 1
        start = pos
        while pos < end and text[pos] in _DIGITS:
            pos += 1
        denom = text[start:pos]
        if pos >= end:
            return positive, text, num, denom, ""
    value, suffix_start = text[:pos], pos
    while pos < end and text[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end and text[pos] in "+-":
        pos += 1
    while pos < end and text[pos] in _DIGITS:
        pos += 1
    if pos < end:
        return None
    return positive, value, num, denom, text[suffix_start:]


def _int32(v: int) -> int:
    return (v + 2**31) % 2**32 - 2**31


def _interpret(suffix: str) -> tuple[int, int, str] | None:
    """(base, exponent, format) of a suffix, or None for an unknown one."""
    if suffix in _DECIMAL:
        return 10, _DECIMAL[suffix], "DecimalSI"
    if suffix in _BINARY:
        return 2, _BINARY[suffix], "BinarySI"
    if len(suffix) > 1 and suffix[0] in "eE":
        digits = suffix[1:]
        body = digits[1:] if digits[:1] in ("+", "-") else digits
        if not body or not set(body) <= _DIGITS:
            return None
        body = body.lstrip("0") or "0"
        if len(body) > 19:  # beyond int64: ParseInt fails
            return None
        parsed = -int(body) if digits.startswith("-") else int(body)
        if not -(2**63) <= parsed <= _MAX_INT64:
            return None
        return 10, _int32(parsed), "DecimalExponent"
    return None


def _decimal(value: str) -> tuple[int, int]:
    """inf.Dec.SetString of `[+-]digits[.digits]`: (unscaled, scale). Through Decimal, which
    has no limit on the digits it converts."""
    sign, digits, exponent = Decimal(value).as_tuple()
    assert isinstance(exponent, int)
    return int(Decimal((sign, digits, 0))), -exponent


def parse_quantity(text: str) -> Quantity | None:
    """apimachinery's ParseQuantity; None where it returns an error (`isQuantity` is false)."""
    if text == "":
        return None
    if text == "0":
        return Quantity(0, 0)
    split = _split(text)
    if split is None:
        return None
    positive, value, num, denom, suffix = split
    meaning = _interpret(suffix)
    if meaning is None:
        return None
    base, exponent, fmt = meaning
    precision, scale, mantissa = 0, 0, 1
    if fmt == "BinarySI":
        if exponent >= 0 and not denom:
            mantissa = 1 << exponent
            precision = 15 - len(num) - int(exponent * 3 / 10) - 1
        else:
            precision = -1
    else:
        scale = exponent
        precision = _MAX_INT64_FACTORS - (len(num) + len(denom))
    if precision >= 0:
        scale -= len(denom)
        if scale >= -_NANO:
            result = int(num + denom) * mantissa
            if result <= _MAX_INT64:
                return Quantity(result if positive else -result, -min(scale, _BEYOND_DOUBLE))
    if not _DIGITS & set(value):  # inf.Dec reads no number from `-`, `.` or nothing
        return None
    unscaled, dec_scale = _decimal(value)
    if base == 10:
        dec_scale -= exponent
    else:
        unscaled <<= exponent
    magnitude = abs(unscaled)
    if magnitude != 0:  # rounded up to nano units, as ParseQuantity does
        down = dec_scale - _NANO
        if down > 0:
            # ceil(m / 10**down) is 1 when 10**down exceeds m: no power that size is formed.
            fits = down > magnitude.bit_length() * 0.30103 + 1
            magnitude = 1 if fits else -(-magnitude // 10**down)
        else:
            magnitude *= 10 ** min(-down, _BEYOND_DOUBLE)
        dec_scale = _NANO
    if fmt == "BinarySI" and Fraction(magnitude) / Fraction(10) ** dec_scale > _MAX_INT64:
        magnitude, dec_scale = _MAX_INT64, 0
    return Quantity(magnitude if unscaled >= 0 else -magnitude, dec_scale)


def format_bytes(amount: Fraction | int) -> str:
    """A byte count as a quantity, rounded up to a whole byte, in the largest binary unit that
    holds it exactly (`96Gi`, `1536Mi`, `1000000000`)."""
    n = math.ceil(amount)
    for suffix, power in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n and n % 2**power == 0:
            return f"{n >> power}{suffix}"
    return str(n)


def gib_bytes(gib: float) -> Fraction:
    """GiB (as the spec writes them, possibly fractional) in bytes, exactly."""
    return Fraction(gib) * GIB


def plain_number(x: float) -> str:
    """A number for an environment variable or a flag: `1`, `0.85`, `1.5`."""
    return str(int(x)) if float(x).is_integer() else repr(float(x))
