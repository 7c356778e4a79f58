"""Kubernetes-style quantities ("48Gi", "512M", "1.5Ti") as whole bytes."""

from __future__ import annotations

import re
from decimal import Decimal
from fractions import Fraction

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
# Kubernetes' grammar: a signed number ("1", "1.5", "1.", ".5", "+4", "-2") and one suffix: binary SI (Ki..Ei),
# decimal SI (m, k, M, G, T, P, E) or a decimal exponent ("e3", "E-2"). "1E" is one exa; "1E3" is a thousand.
_QUANTITY = re.compile(
    r"^(?P<sign>[+-]?)(?P<number>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)"
    r"(?:(?P<exponent>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|m|k|M|G|T|P|E)?)$"
)
# Far beyond any real quantity; keeps a hostile "1e999999999" from costing time or memory.
_MAX_EXPONENT = 100


def parse_quantity(text: str) -> Fraction:
    """A Kubernetes quantity ("48Gi", "500m", "2.5", "8e9", "+4Gi", ".5") as an exact number. Raises ValueError."""
    match = _QUANTITY.fullmatch(text.strip())
    if match is None:
        allowed = ", ".join(s for s in _SUFFIXES if s)
        raise ValueError(f"expected a quantity such as 48Gi (suffixes: m, {allowed}, or an exponent e3), got {text!r}")
    number = Fraction(Decimal(match["number"]))
    if match["sign"] == "-":
        number = -number
    if match["exponent"]:
        exponent = int(match["exponent"][1:])
        if abs(exponent) > _MAX_EXPONENT:
            raise ValueError(f"exponent out of range in {text!r}")
        return number * Fraction(10) ** exponent
    suffix = match["suffix"] or ""
    return number / 1000 if suffix == "m" else number * _SUFFIXES[suffix]


def format_quantity(value: Fraction, binary: bool = False) -> str:
    """A non-negative exact number as a Kubernetes quantity: whole numbers plainly (with the largest binary suffix
    that divides them when ``binary``), else in milli-units."""
    if value.denominator == 1:
        if binary and value.numerator:
            for suffix in ("Ti", "Gi", "Mi", "Ki"):
                factor = _SUFFIXES[suffix]
                if value.numerator % factor == 0:
                    return f"{value.numerator // factor}{suffix}"
        return str(value.numerator)
    millis = value * 1000
    if millis.denominator == 1:
        return f"{millis.numerator}m"
    return str(Decimal(value.numerator) / Decimal(value.denominator))


# The most bytes a quantity may be: what a signed 64-bit count holds (8Ei less one byte). The Vulkan layer counts
# a container's memory in one, and Kubernetes' quantities go no further.
MAX_BYTES = 2**63 - 1


def parse_bytes(value: object) -> int:
    """Parse a byte quantity, at most MAX_BYTES. Raises ValueError with a message fit for a config error."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ValueError(f"expected a byte quantity such as 48Gi, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"must not be negative, got {value}")
        return _at_most_max(value, value)
    try:
        total = parse_quantity(value)
    except ValueError:
        allowed = ", ".join(s for s in _SUFFIXES if s)
        raise ValueError(f"expected a byte quantity such as 48Gi (suffixes: {allowed}), got {value!r}") from None
    if total < 0:
        raise ValueError(f"must not be negative, got {value!r}")
    if total.denominator != 1:
        raise ValueError(f"must be a whole number of bytes, got {value!r}")
    return _at_most_max(total.numerator, value)


def _at_most_max(total: int, given: object) -> int:
    if total > MAX_BYTES:
        raise ValueError(f"must be less than 8Ei (at most {MAX_BYTES} bytes, what a 64-bit count holds), "
                         f"got {given!r}")
    return total


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
    if isinstance(value, str) and (match := _DURATION.fullmatch(value)):
        return float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    raise ValueError(f"expected a duration such as 500ms, 5s or 2m (or a number of seconds), got {value!r}")
