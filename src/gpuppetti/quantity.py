"""Kubernetes-style quantities ("48Gi", "512M", "1.5Ti") as whole bytes."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, int] = {
    "": 1,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
    "Pi": 1024**5,
    "Ei": 1024**6,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
}
_QUANTITY = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: object) -> int:
    """Parse a byte quantity. Raises ValueError with a message fit for a config error."""
    if isinstance(value, bool):
        raise ValueError(f"expected a byte quantity such as 48Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must not be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise ValueError(f"expected a byte quantity such as 48Gi, got {value!r}")
    match = _QUANTITY.match(value)
    if not match or match.group(2) not in _SUFFIXES:
        allowed = ", ".join(s for s in _SUFFIXES if s)
        raise ValueError(f"expected a byte quantity such as 48Gi (suffixes: {allowed}), got {value!r}")
    try:
        number = Decimal(match.group(1))
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"not a number: {value!r}") from exc
    total = number * _SUFFIXES[match.group(2)]
    if total != total.to_integral_value():
        raise ValueError(f"must be a whole number of bytes, got {value!r}")
    return int(total)


def format_bytes(value: int | None) -> str:
    """Render bytes in the largest binary unit that keeps one decimal, e.g. 48 GiB."""
    if value is None:
        return "-"
    for suffix, factor in (("EiB", 1024**6), ("PiB", 1024**5), ("TiB", 1024**4), ("GiB", 1024**3),
                           ("MiB", 1024**2), ("KiB", 1024)):
        if value >= factor:
            amount = value / factor
            text = f"{amount:.1f}".removesuffix(".0")
            return f"{text} {suffix}"
    return f"{value} B"


_DURATION = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """Parse seconds (a number) or a duration such as "500ms", "5s", "2m". Raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"expected a duration such as 5s, got {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"must not be negative, got {value}")
        return float(value)
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    raise ValueError(f"expected a duration such as 500ms, 5s or 2m (or a number of seconds), got {value!r}")
