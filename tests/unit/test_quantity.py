from __future__ import annotations

import pytest

from gpuppetti.quantity import format_bytes, parse_bytes


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
