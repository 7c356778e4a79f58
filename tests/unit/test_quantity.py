from __future__ import annotations

from fractions import Fraction

import pytest

from gpuppetti.base.quantity import format_bytes, parse_bytes, parse_quantity


@pytest.mark.parametrize(
    ("value", "expected"),
    [("48Gi", 48 * 2**30), ("512Mi", 512 * 2**20), ("1.5Ki", 1536), ("2G", 2 * 10**9), ("100", 100), (4096, 4096),
     ("1Ti", 2**40), ("0", 0)],
)
def test_parse(value: object, expected: int) -> None:
    assert parse_bytes(value) == expected


@pytest.mark.parametrize("value", ["48Gb", "lots", "-1Gi", "0.5", True, 1.5, -3, "1.1Ki"])
def test_parse_rejects(value: object) -> None:
    with pytest.raises(ValueError):
        parse_bytes(value)


def test_format() -> None:
    assert format_bytes(48 * 2**30) == "48 GiB"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(12) == "12 B"
    assert format_bytes(None) == "-"


@pytest.mark.parametrize(("text", "expected"), [
    ("8e9", 8 * 10**9), ("1E3", 1000), ("1E", 10**18), ("+4Gi", 4 * 2**30), (".5", Fraction(1, 2)),
    ("1.", 1), ("500m", Fraction(1, 2)), ("2.5e-1", Fraction(1, 4)), ("-3", -3), ("12Gi", 12 * 2**30),
])
def test_every_form_of_the_kubernetes_grammar(text: str, expected: Fraction) -> None:
    assert parse_quantity(text) == expected


@pytest.mark.parametrize("text", ["", "Gi", "1.5.2", "1e", "1 Gi", "1GI", "1e3Gi", "e3", "1ee3", "1e99999"])
def test_quantities_outside_the_grammar(text: str) -> None:
    with pytest.raises(ValueError):
        parse_quantity(text)


def test_a_byte_quantity_is_at_most_what_a_64_bit_count_holds() -> None:
    # The Vulkan layer counts a container's memory in a signed 64-bit integer.
    assert parse_bytes(2**63 - 1) == 2**63 - 1
    for value in ("8Ei", 2**63, "9223372036854775808", "100Ei", "1e19"):
        with pytest.raises(ValueError, match=r"must be less than 8Ei \(at most 9223372036854775807 bytes"):
            parse_bytes(value)
