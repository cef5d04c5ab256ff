"""Quantities and doubles as the API server's CEL reads and writes them. The expected values
were produced by Kubernetes v1.33's own CEL (`isQuantity`, `quantity(s).asApproximateFloat()`,
`'%s'.format([double])`), compiled and evaluated as the API server does for a CRD."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest

from pdd_api.quantity import Quantity, format_bytes, parse_quantity, plain_number
from pdd_api.rules import cel_double


def quantity(text: str) -> Quantity:
    q = parse_quantity(text)
    assert q is not None, text
    return q

# (quantity, asApproximateFloat; None where isQuantity is false)
GO_QUANTITIES: list[tuple[str, float | None]] = [
    ("16Gi", 1.7179869184e10), ("1.5Gi", 1.610612736e09), ("0.3Gi", 3.2212254720000005e08),
    ("100G", 1e11), ("64000Mi", 6.7108864e10), ("0", 0.0), ("-", 0.0), ("+1Gi", 1.073741824e09),
    ("1e3", 1000.0), ("1E3", 1000.0), ("500m", 0.5), ("abc", None), ("", None), ("1e+", None),
    ("12345678901234567890", 1.234567890123457e19), ("1e-20", 1e-09),
    ("1Ei", 1.152921504606847e18), ("16Ei", 9.223372036854776e18), ("0e400", math.nan),
    ("1.Gi", 1.073741824e09), (".5Gi", 5.36870912e08), ("007Mi", 7.340032e06),
    ("1e-5", 1e-05), (" 1Gi", None), ("1gi", None), ("2.5e3", 2500.0),
    ("1.000000001", 1.000000001), ("-1Gi", -1.073741824e09),
    ("9223372036854775807", 9.223372036854776e18), ("9223372036854775808", 9.223372036854776e18),
    # A suffix without a number: valid where Go's fast path reads it, not where inf.Dec must.
    ("Pi", None), ("-Pi", None), (".Pi", None), ("e-20", None), (".e-20", None),
    ("Gi", 0.0), ("+Gi", 0.0), (".Gi", 0.0), ("E", 0.0), ("00Pi", 0.0), (".", 0.0),
    ("1.Pi", 1.125899906842624e15), ("+.5Pi", 5.62949953421312e14), ("5.e-20", 1e-09),
    ("1.", 1.0), ("1.5Ki", 1536.0), ("1e+", None), ("E-", None), ("59.3206E-", None),
    ("1e0000000000000000000000005", 1e5), ("1e" + "9" * 30, None),
]


@pytest.mark.parametrize(("text", "want"), GO_QUANTITIES)
def test_quantities_parse_as_the_api_server_parses_them(text: str, want: float | None) -> None:
    q = parse_quantity(text)
    if want is None:
        assert q is None
        return
    assert q is not None
    got = q.approximate_float()
    assert (math.isnan(got) and math.isnan(want)) or got == want


@pytest.mark.parametrize(("text", "want"), [
    ("1e-999999999", 1e-09), ("1e2000000000", math.inf), ("9" * 6000 + "Gi", 2.0**63 - 1),
    ("-" + "0" * 5000 + "1.5Gi", -1.610612736e09)])
def test_absurd_quantities_are_read_at_once(text: str, want: float) -> None:
    """Exponents and digits a memory value could carry to stall the webhook: no power of ten
    beyond a double's range is ever formed (Kubernetes itself hangs on the first one)."""
    assert quantity(text).approximate_float() == want


def test_exact_values_keep_every_byte() -> None:
    assert quantity("1.5Gi").exact == 3 * 2**29
    assert quantity("100G").exact == 10**11
    assert quantity("500m").exact == Fraction(1, 2)


@pytest.mark.parametrize(("x", "want"), [
    (1, "1"), (1.0, "1"), (1.5, "1.5"), (0.9, "0.9"), (1e6, "1e+06"), (123456.0, "123456"),
    (1e21, "1e+21"), (1e-5, "1e-05"), (0.0001, "0.0001"), (0.1 + 0.2, "0.30000000000000004"),
    (float(2**53), "9.007199254740992e+15"), (1e20, "1e+20"), (100000.0, "100000"),
    (-0.25, "-0.25"), (17179869184, "1.7179869184e+10")])
def test_doubles_are_written_as_cel_writes_them(x: float, want: str) -> None:
    assert cel_double(x) == want


@pytest.mark.parametrize(("amount", "want"), [
    (96 * 2**30, "96Gi"), (1536 * 2**20, "1536Mi"), (2**40, "1Ti"), (10**9, "1000000000"),
    (Fraction(3, 2), "2"), (98704826 * 1024, "98704826Ki"), (0, "0")])
def test_byte_counts_in_the_largest_unit_that_holds_them(amount: Fraction | int,
                                                         want: str) -> None:
    assert format_bytes(amount) == want
    assert quantity(want).exact == math.ceil(amount)


def test_env_numbers() -> None:
    assert [plain_number(x) for x in (0.85, 1.0, 8, 1.5)] == ["0.85", "1", "8", "1.5"]
