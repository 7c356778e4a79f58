"""Delivering the Vulkan layer: installed once per node, mounted into each container given a share of a GPU.

At start a daemon copies the layer's library and probe (built with the package, in ``gpuppetti/_native``) into
the layer directory (``--vulkan-layer-dir``) and writes the layer's manifest beside them. Each allocation then gets
a directory of its own under ``ledgers/``, holding nothing but the socket of its ledger (layer/ledger.py), which the
daemon serves; its container gets read-only mounts of the manifest (into the standard implicit layer directory:
Debian 12's loader ignores VK_ADD_LAYER_PATH for implicit layers), the library, the probe and that directory, and
the env that names its slices. Nothing a container mounts from the node is writable.

What the device plugin knows of an allocation (the units it was made for, its slices' terms) it keeps in
``records/``, beside ``ledgers/`` and mounted into no container, so that a restarted plugin serves the ledgers of
the allocations its containers hold.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.fsutil import atomic_write, make_directory, read_untrusted, remove_file, remove_tree
from gpuppetti.core.model import ContainerEdits, Mount
from gpuppetti.layer.ledger import SOCKET_NAME, Terms
from gpuppetti.layer.ledgers import Ledgers
from gpuppetti.sharing.budgets import WHOLE_COMPUTE, Budget
from gpuppetti.sharing.limits import DMEM_HOOK

log = logging.getLogger(__name__)

LAYER_NAME = "VK_LAYER_GPUPPETTI_slice"
LIBRARY = "libVkLayer_gpuppetti.so"
PROBE = "gpuppetti-vkinfo"
MANIFEST = "VkLayer_gpuppetti.json"
LEDGERS = "ledgers"
# The device plugin's own record of each allocation (its units and its slices' terms, JSON): root's, in no container.
RECORDS = "records"
RECORD_LIMIT = 1 << 20
# What earlier versions kept in the layer directory: accounting directories the containers wrote, and the DRA
# driver's trash of them. Removed at start.
LEGACY = ("allocations", "dra-trash")
# Where the built layer is, inside the package.
BUILT = Path(__file__).resolve().parent.parent / "_native"

# Inside the container.
CONTAINER_MANIFEST = f"/etc/vulkan/implicit_layer.d/{MANIFEST}"
CONTAINER_LIBRARY = f"/usr/lib/gpuppetti/{LIBRARY}"
CONTAINER_PROBE = f"/usr/local/bin/{PROBE}"
CONTAINER_LEDGER_DIR = "/run/gpuppetti/vulkan"
CONTAINER_LEDGER = f"{CONTAINER_LEDGER_DIR}/{SOCKET_NAME}"
DISABLE_ENV = "GPUPPETTI_VK_DISABLE"
# The most a slice's budget may be: the layer counts in int64.
MAX_BUDGET = (1 << 63) - 1

# An allocation's directory name: it is built from unit ids and claim UIDs, and must stay one path component.
_ALLOCATION_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# How to get an installation that has the layer: what `discover`, `doctor` and the daemons tell a user who lacks it.
BUILD_FIX = ("install a gpuppetti wheel that carries the layer (make dist's manylinux wheels and the image do), or "
             "install a C compiler and libvulkan-dev (Debian: gcc libvulkan-dev) and reinstall from source "
             "(pip install --force-reinstall --no-deps . in a checkout, or make native there)")
# What the package build leaves in place of the layer where it could not build it: why (setup.py writes it).
NOT_BUILT = "NOT_BUILT"


class LayerUnavailable(Exception):
    """The layer cannot be delivered; the message says why."""


def missing_files(built: Path = BUILT) -> list[str]:
    """What this installation lacks of the built layer and its probe (none: it can enforce slices)."""
    return [name for name in (LIBRARY, PROBE) if not (built / name).is_file()]


def not_built(built: Path = BUILT) -> str:
    """Why this installation has no layer, as its build recorded it ("" where it did not: a checkout, say)."""
    try:
        why = (built / NOT_BUILT).read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return ""
    return f"it was built without one ({why[:200]})" if why else ""


@dataclass(frozen=True)
class Enforcement:
    """Whether a daemon holds containers to their slices, and if not, why: said on /healthz, in /metrics, at start
    and by the demo."""

    layer: LayerDir | None
    reason: str
    # The allocations' ledgers, where slices are enforced.
    ledgers: Ledgers | None = None

    @property
    def enforced(self) -> bool:
        return self.layer is not None

    def note(self) -> str | None:
        """What /healthz adds to a ready answer: nothing where slices are enforced."""
        return None if self.enforced else f"slices are not enforced: {self.reason}"

    def summary(self) -> str:
        """One line of at most 80 columns."""
        if self.enforced:
            return "slices are enforced: each container is held to its slice by the Vulkan layer"
        line = f"slices are NOT enforced: {self.reason}"
        return line if len(line) <= 80 else line[:77] + "..."


def manifest() -> dict[str, object]:
    return {
        "file_format_version": "1.1.2",
        "layer": {
            "name": LAYER_NAME,
            "type": "GLOBAL",
            "library_path": CONTAINER_LIBRARY,
            "api_version": "1.3.0",
            "implementation_version": "1",
            "description": "gpuppetti: a GPU slice's memory, as the container's GPU",
            "functions": {"vkNegotiateLoaderLayerInterfaceVersion": "vkNegotiateLoaderLayerInterfaceVersion"},
            # The layer provides VK_EXT_memory_budget where the driver does not (Venus, lavapipe).
            "device_extensions": [{"name": "VK_EXT_memory_budget", "spec_version": "1", "entrypoints": []}],
            "disable_environment": {DISABLE_ENV: "1"},
        },
    }


def slices_env(budgets: Sequence[Budget]) -> str:
    return ",".join(f"{budget.selector}={budget.memory}" for budget in budgets)


def compute_env(budgets: Sequence[Budget]) -> str | None:
    """GPUPPETTI_VK_COMPUTE: each slice's share of its GPU's time, in the order of GPUPPETTI_VK_SLICES; None where
    no slice is throttled."""
    if all(budget.compute >= WHOLE_COMPUTE for budget in budgets):
        return None
    return ",".join(str(budget.compute) for budget in budgets)


def terms(budgets: Sequence[Budget]) -> list[Terms]:
    """Each slice's terms, as its ledger holds them."""
    return [Terms(budget.memory, budget.compute) for budget in budgets]


def check_allocation_id(allocation: str) -> None:
    """Raises ValueError for an id that is not one path component of the allowed characters."""
    if not _ALLOCATION_ID.fullmatch(allocation):
        raise ValueError(f"not an allocation id: {allocation[:80]!r}")


@dataclass(frozen=True)
class Record:
    """What the device plugin made an allocation for: its units, and its slices' terms."""

    units: list[str]
    terms: list[Terms]


@dataclass(frozen=True)
class LayerDir:
    """The node's layer directory: the installed layer, each allocation's ledger directory, and the device plugin's
    record of each allocation."""

    path: Path

    @property
    def ledgers(self) -> Path:
        return self.path / LEDGERS

    @property
    def records(self) -> Path:
        return self.path / RECORDS

    def install(self, built: Path = BUILT) -> None:
        """Copy the built layer and probe in, and write the manifest; what an earlier version kept here goes.
        Blocks (file I/O): run it in a thread. Raises LayerUnavailable."""
        missing = missing_files(built)
        if missing:
            why = not_built(built)
            raise LayerUnavailable(f"this installation has no built Vulkan layer ({', '.join(missing)} missing in "
                                   f"{built}{'; ' + why if why else ''}); {BUILD_FIX}")
        try:
            make_directory(self.path, 0o755)
            make_directory(self.ledgers, 0o755)
            make_directory(self.records, 0o700)
            for name in (LIBRARY, PROBE):
                atomic_write(self.path / name, (built / name).read_bytes(), 0o755)
            atomic_write(self.path / MANIFEST, json.dumps(manifest(), indent=2).encode() + b"\n", 0o644)
            # The dmem hook, which a claim's CDI spec names where the kernel holds slices too.
            atomic_write(self.path / DMEM_HOOK, (Path(__file__).parent / "dmem_hook.py").read_bytes(), 0o755)
        except OSError as exc:
            raise LayerUnavailable(f"cannot install the Vulkan layer in {self.path}: {exc.strerror or exc}") from exc
        self.remove_legacy()

    def remove_legacy(self) -> None:
        """The accounting directories an earlier version let containers write: removed (a bounded pass; what is
        left is tried again at the next start). A container still running from then keeps what it mapped."""
        for name in LEGACY:
            if os.path.lexists(self.path / name):
                why = remove_tree(self.path / name)
                if why is None:
                    log.info("removed %s, which an earlier version kept in %s", name, self.path)
                else:
                    log.warning("%s, which an earlier version kept in %s, is not all removed yet (%s): tried again "
                                "at the next start", name, self.path, why)

    def write_record(self, allocation: str, record: Record) -> None:
        """Blocks (a small file): run it in a thread. Raises OSError, or ValueError for a bad id."""
        check_allocation_id(allocation)
        data = json.dumps({"units": record.units,
                           "terms": [[t.budget, t.compute] for t in record.terms]}).encode()
        try:
            atomic_write(self.records / allocation, data, 0o600, durable=False)
        except FileNotFoundError:
            make_directory(self.records, 0o700)
            atomic_write(self.records / allocation, data, 0o600, durable=False)

    def remove_record(self, allocation: str) -> None:
        if _ALLOCATION_ID.fullmatch(allocation):
            try:
                remove_file(self.records / allocation)
            except OSError as exc:
                log.warning("cannot remove the record of allocation %s: %s", allocation, exc.strerror or exc)

    def read_records(self) -> dict[str, Record | None]:
        """Each recorded allocation (None for a record that does not parse: an earlier version's, say). Blocks."""
        found: dict[str, Record | None] = {}
        try:
            entries = list(os.scandir(self.records))
        except OSError:
            return found
        for entry in entries:
            if not _ALLOCATION_ID.fullmatch(entry.name):
                continue
            found[entry.name] = _parse_record(read_untrusted(entry.path, RECORD_LIMIT) or b"")
        return found

    def edits(self, allocation: str, budgets: Sequence[Budget]) -> ContainerEdits:
        """What a container needs to run under the layer, held to ``budgets`` by the allocation's ledger."""
        edits = ContainerEdits(env={
            "GPUPPETTI_VK_SLICES": slices_env(budgets),
            "GPUPPETTI_VK_LEDGER": CONTAINER_LEDGER,
            "GPUPPETTI_LIMITS": "vulkan",
        })
        if (compute := compute_env(budgets)) is not None:
            edits.env["GPUPPETTI_VK_COMPUTE"] = compute
        edits.add_mount(Mount(CONTAINER_MANIFEST, str(self.path / MANIFEST), read_only=True))
        edits.add_mount(Mount(CONTAINER_LIBRARY, str(self.path / LIBRARY), read_only=True))
        edits.add_mount(Mount(CONTAINER_PROBE, str(self.path / PROBE), read_only=True))
        edits.add_mount(Mount(CONTAINER_LEDGER_DIR, str(self.ledgers / allocation), read_only=True))
        return edits


def _parse_record(data: bytes) -> Record | None:
    try:
        document = json.loads(data)
        units = [str(unit) for unit in document["units"]]
        kept = [Terms(int(budget), int(compute)) for budget, compute in document["terms"]]
    except (ValueError, KeyError, TypeError):
        return None
    return Record(units, kept)


async def install_layer(directory: Path | None) -> Enforcement:
    """The Vulkan layer installed for the containers, or why slices cannot be enforced (said in the log too)."""
    if directory is None:
        log.warning("slices are not enforced: --vulkan-layer-dir is empty")
        return Enforcement(None, "--vulkan-layer-dir is empty")
    layer = LayerDir(directory)
    try:
        await asyncio.to_thread(layer.install)
    except LayerUnavailable as exc:
        log.warning("slices are not enforced: %s", exc)
        short = str(exc)
        if missing_files():
            built_without = not_built()
            short = f"this installation has no built Vulkan layer{': ' + built_without if built_without else ''}"
        return Enforcement(None, short)
    log.info("slices are enforced through the Vulkan layer in %s; each allocation's ledger is served in %s",
             directory, layer.ledgers)
    return Enforcement(layer, f"the Vulkan layer in {directory}", Ledgers(layer.ledgers))
