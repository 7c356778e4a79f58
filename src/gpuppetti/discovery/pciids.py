"""Model names from the PCI ID database (pci.ids, as Debian's pci.ids and hwdata packages install it)."""

from __future__ import annotations

import functools
from pathlib import Path

# Searched under the host root first (the node's own database), then in this container or machine.
DATABASE_PATHS = ("usr/share/misc/pci.ids", "usr/share/hwdata/pci.ids", "usr/share/pci.ids")


def find_database(host_root: Path) -> Path | None:
    for base in (host_root, Path("/")):
        for relative in DATABASE_PATHS:
            candidate = base / relative
            if candidate.is_file():
                return candidate
    return None


@functools.lru_cache(maxsize=8)
def _vendor_table(database: Path, vendor: str) -> tuple[str | None, dict[str, str]]:
    vendor_name: str | None = None
    devices: dict[str, str] = {}
    inside = False
    with database.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.strip() or line.startswith("#"):
                continue
            if not line.startswith("\t"):
                if inside:
                    break
                if line[:4].lower() == vendor:
                    vendor_name = line[4:].strip()
                    inside = True
                continue
            if inside and not line.startswith("\t\t"):
                devices[line[1:5].lower()] = line[5:].strip()
    return vendor_name, devices


def model_name(database: Path | None, vendor: str, device: str) -> str | None:
    """``"Navi 31 [Radeon RX 7900 XT/7900 XTX]"`` for ``("1002", "744c")``, or None if unknown."""
    if database is None:
        return None
    _, devices = _vendor_table(database, vendor.lower())
    return devices.get(device.lower())
