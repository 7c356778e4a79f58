"""Delivering the Vulkan layer: installed once per node, mounted into each container given a share of a GPU.

At start a daemon copies the layer's library and probe (built with the package, in ``gpuppetti/_native``) into
the layer directory (``--vulkan-layer-dir``) and writes the layer's manifest beside them. Each allocation then gets
a directory of its own under ``allocations/``, with one accounting file per GPU (the layout of
native/vulkan-layer/accounting.h), and its container gets read-only mounts of the manifest (into the standard
implicit layer directory: Debian 12's loader ignores VK_ADD_LAYER_PATH for implicit layers), the library and the
probe, a read-write mount of its allocation directory, and the env that names its slices.

The allocation directory is the tenant's: nothing in it is trusted. What the daemon knows of an allocation (the
units it was made for) it keeps in ``records/``, beside ``allocations/`` and mounted into no container. Where the
daemon may mount and its mounts reach the container runtime, each allocation directory is a tmpfs of its own, just
large enough for its accounting files, so that a tenant cannot fill the node's disk through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.fsutil import (
    atomic_write,
    create_file,
    is_mount_point,
    make_directory,
    mount_tmpfs,
    mounts_propagate,
    open_untrusted,
    read_untrusted,
    remove_file,
    remove_tree,
    unmount,
)
from gpuppetti.core.model import ContainerEdits, Mount
from gpuppetti.sharing.budgets import WHOLE_COMPUTE, Budget
from gpuppetti.sharing.limits import DMEM_HOOK

log = logging.getLogger(__name__)

LAYER_NAME = "VK_LAYER_GPUPPETTI_slice"
LIBRARY = "libVkLayer_gpuppetti.so"
PROBE = "gpuppetti-vkinfo"
MANIFEST = "VkLayer_gpuppetti.json"
ALLOCATIONS = "allocations"
# The daemon's own record of each allocation (the units it was made for, one per line): root's, in no container.
RECORDS = "records"
RECORD_LIMIT = 1 << 20
# An allocation directory's own tmpfs: room for its accounting files and this much more, and this many files more
# than it holds (what a tenant may write there at most).
TMPFS_MARGIN = 64 << 10
TMPFS_SPARE_FILES = 16
PAGE = 4096
# Where the built layer is, inside the package.
BUILT = Path(__file__).resolve().parent.parent / "_native"

# Inside the container.
CONTAINER_MANIFEST = f"/etc/vulkan/implicit_layer.d/{MANIFEST}"
CONTAINER_LIBRARY = f"/usr/lib/gpuppetti/{LIBRARY}"
CONTAINER_PROBE = f"/usr/local/bin/{PROBE}"
CONTAINER_ACCOUNTING = "/run/gpuppetti/vulkan"
DISABLE_ENV = "GPUPPETTI_VK_DISABLE"

# The accounting file, as native/vulkan-layer/accounting.h lays it out.
ACCT_MAGIC = b"GPPTVK01"
ACCT_VERSION = 1
ACCT_SLOTS = 256
ACCT_FILE_SIZE = 36864
# Where the compute duty cycle keeps the slice's next allowed submit (CLOCK_MONOTONIC ns; accounting.h).
ACCT_NOT_BEFORE_OFFSET = 34976
# How long the slice's submits have waited in all (ns; accounting.h).
ACCT_WAITED_OFFSET = 34984
# What each process slot holds (int64 each), and what no slot holds (exported memory): accounting.h.
ACCT_SLOT_BYTES_OFFSET = 160
ACCT_UNOWNED_OFFSET = 34992
# Each live process holds an open-file-description lock on its slot's byte from here; the kernel drops it when the
# process dies, whatever PID namespace it ran in.
ACCT_LOCK_BASE = 1048576
# The most one figure may say (the container writes the file): far above any GPU's memory.
ACCT_FIGURE_LIMIT = 1 << 60
# struct flock on 64-bit Linux: l_type, l_whence, l_start, l_len, l_pid (and padding).
_FLOCK = struct.Struct("@hhqqi4x")
# Slices read per allocation at most (a container given more GPUs than this is reported for the first ones).
MAX_SLICES_READ = 64

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


def _header(budget: int) -> bytes:
    return ACCT_MAGIC + struct.pack("<IIq", ACCT_VERSION, ACCT_SLOTS, budget)


def _holds_header(path: str) -> bool:
    """Whether ``path`` is an accounting file that was written whole (a crash can leave one created but empty)."""
    return read_untrusted(path, len(ACCT_MAGIC)) == ACCT_MAGIC


def _clear_not_before(path: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.pwrite(fd, bytes(8), ACCT_NOT_BEFORE_OFFSET)
    except OSError:
        pass  # swapped for something else since it was read: the layer's own bound on a wait still holds
    finally:
        os.close(fd)


@dataclass(frozen=True)
class SliceUse:
    """What the layer's accounting file of one slice says: its budget, what the container's live processes hold (and
    the exported memory that outlives them), and how long their submits waited for the slice's share of the GPU's
    time. The container can write the file: each number is clamped to 0..ACCT_FIGURE_LIMIT."""

    index: int
    budget: int
    used: int
    waited_seconds: float


def _figure(data: bytes, offset: int) -> int:
    """One int64 of the file, clamped; 0 where the file is too short to hold it."""
    if len(data) < offset + 8:
        return 0
    value: int = struct.unpack_from("<q", data, offset)[0]
    return min(max(value, 0), ACCT_FIGURE_LIMIT)


def _slot_live(fd: int, slot: int) -> bool:
    """Whether a live process holds slot's lock (any lock there would stop a write lock)."""
    query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, ACCT_LOCK_BASE + slot, 1, 0)
    kind: int = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_OFD_GETLK, query))[0]
    return kind != fcntl.F_UNLCK


def read_use(path: str, index: int) -> SliceUse | None:
    """One accounting file's figures; None where it is not one (missing, a link, not a regular file, not the
    layout). Only live processes' slots count: what a killed process held leaves the figure as it dies."""
    fd = open_untrusted(path)
    if fd is None:
        return None
    try:
        data = os.pread(fd, ACCT_UNOWNED_OFFSET + 8, 0)
        if len(data) < 32 or not data.startswith(ACCT_MAGIC):
            return None
        used = _figure(data, ACCT_UNOWNED_OFFSET)
        for slot in range(ACCT_SLOTS):
            held = _figure(data, ACCT_SLOT_BYTES_OFFSET + 8 * slot)
            if held and _slot_live(fd, slot):
                used += held
        return SliceUse(index, _figure(data, 16), min(used, ACCT_FIGURE_LIMIT),
                        _figure(data, ACCT_WAITED_OFFSET) / 1e9)
    except OSError:
        return None
    finally:
        os.close(fd)


def slices_env(budgets: Sequence[Budget]) -> str:
    return ",".join(f"{budget.selector}={budget.memory}" for budget in budgets)


def compute_env(budgets: Sequence[Budget]) -> str | None:
    """GPUPPETTI_VK_COMPUTE: each slice's share of its GPU's time, in the order of GPUPPETTI_VK_SLICES; None where
    no slice is throttled."""
    if all(budget.compute >= WHOLE_COMPUTE for budget in budgets):
        return None
    return ",".join(str(budget.compute) for budget in budgets)


@dataclass(frozen=True)
class LayerDir:
    """The node's layer directory: the installed layer, one directory per allocation, and the daemon's record of
    each. ``bounded``: each allocation directory is a tmpfs of its own (see ``why_unbounded``)."""

    path: Path
    bounded: bool = False

    @property
    def allocations(self) -> Path:
        return self.path / ALLOCATIONS

    @property
    def records(self) -> Path:
        return self.path / RECORDS

    def install(self, built: Path = BUILT) -> None:
        """Copy the built layer and probe in, and write the manifest. Blocks (file I/O): run it in a thread.
        Raises LayerUnavailable."""
        missing = missing_files(built)
        if missing:
            why = not_built(built)
            raise LayerUnavailable(f"this installation has no built Vulkan layer ({', '.join(missing)} missing in "
                                   f"{built}{'; ' + why if why else ''}); {BUILD_FIX}")
        try:
            make_directory(self.path, 0o755)
            make_directory(self.allocations, 0o755)
            make_directory(self.records, 0o700)
            for name in (LIBRARY, PROBE):
                atomic_write(self.path / name, (built / name).read_bytes(), 0o755)
            atomic_write(self.path / MANIFEST, json.dumps(manifest(), indent=2).encode() + b"\n", 0o644)
            # The dmem hook, which a claim's CDI spec names where the kernel holds slices too.
            atomic_write(self.path / DMEM_HOOK, (Path(__file__).parent / "dmem_hook.py").read_bytes(), 0o755)
        except OSError as exc:
            raise LayerUnavailable(f"cannot install the Vulkan layer in {self.path}: {exc.strerror or exc}") from exc

    def why_unbounded(self) -> str | None:
        """Why allocation directories cannot each be a tmpfs here; None where they can: the daemon may mount, and
        its mounts reach the container runtime. Blocks: run it in a thread."""
        if not mounts_propagate(self.allocations):
            return (f"{self.allocations} is not on a shared mount, so a mount made there would not reach the "
                    "containers (in a DaemonSet: mountPropagation Bidirectional on the layer directory's volume)")
        probe = self.path / ".mount-check"
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(probe, 0o700)
            mount_tmpfs(probe, PAGE, 2)
            unmount(probe)
        except OSError as exc:
            return f"the daemon may not mount a tmpfs ({exc.strerror or exc}; it needs CAP_SYS_ADMIN)"
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(probe)
        return None

    def create(self, allocation: str, memories: Sequence[int], units: Sequence[str] = (), fresh: bool = True) -> Path:
        """The allocation's directory, with an accounting file per GPU (one per budget, in order), and the record
        of the ``units`` it is for. ``fresh`` starts each from zero; otherwise a file that is there is kept (a
        restarted driver must not forget what running containers hold). Blocks: run it in a thread. Raises
        OSError, or ValueError for a bad id."""
        if not _ALLOCATION_ID.fullmatch(allocation):
            raise ValueError(f"not an allocation id: {allocation[:80]!r}")
        # On the device plugin's Allocate path: a few system calls, no temporary files. Nothing reads these files
        # before the container starts, which is after the answer, so no reader can see one half-written.
        directory = os.path.join(self.allocations, allocation)
        try:
            os.mkdir(directory, 0o755)
            os.chmod(directory, 0o755)
        except FileExistsError:
            pass
        if self.bounded:
            self._bound(directory, len(memories), fresh)
        for index, memory in enumerate(memories):
            path = os.path.join(directory, f"slice-{index}.acct")
            if not fresh and _holds_header(path):
                # Kept: running containers count in it. But the time before which the slice may not submit
                # again is from a clock that a reboot starts again: forgiven.
                _clear_not_before(path)
                continue
            # Any user a container runs as counts in it.
            create_file(path, _header(memory), 0o666, ACCT_FILE_SIZE)
        if units:
            record = os.path.join(self.records, allocation)
            data = ("\n".join(units) + "\n").encode()
            try:
                create_file(record, data, 0o600)
            except FileNotFoundError:
                make_directory(self.records, 0o700)
                create_file(record, data, 0o600)
        return Path(directory)

    @staticmethod
    def _bound(directory: str, slices: int, fresh: bool) -> None:
        """Give ``directory`` a tmpfs of its own, sized for ``slices`` accounting files; a fresh one where
        ``fresh`` (whatever a tenant left goes), the one there otherwise."""
        if is_mount_point(directory):
            if not fresh:
                return
            unmount(directory)
        elif not fresh and any(os.scandir(directory)):
            # Files a running container counts in, from before the daemon bounded directories: kept as they are.
            return
        pages = -(-ACCT_FILE_SIZE // PAGE)
        mount_tmpfs(directory, slices * pages * PAGE + TMPFS_MARGIN, slices + TMPFS_SPARE_FILES)

    def remove(self, allocation: str) -> bool:
        """Remove the allocation's directory (its tmpfs first) and its record; whether that is done. What cannot
        go yet (a file that cannot be removed, more entries than one call takes) is logged and left for a later
        call. Never raises. Blocks: run it in a thread. A bounded directory is a mount point, which rename(2)
        refuses (EBUSY): it goes through here, not by moving it elsewhere first."""
        if not _ALLOCATION_ID.fullmatch(allocation):
            return True
        directory = os.path.join(self.allocations, allocation)
        why: str | None = None
        if is_mount_point(directory):
            try:
                unmount(directory)
            except OSError as exc:
                why = f"cannot unmount it: {exc.strerror or exc}"
        why = remove_tree(directory) or why
        if why is not None:
            log.warning("the layer directory of allocation %s is not all removed yet (%s): tried again later",
                        allocation, why)
            return False
        with contextlib.suppress(OSError):
            remove_file(self.records / allocation)
        return True

    def usage(self, allocation: str, slices: int = MAX_SLICES_READ) -> list[SliceUse]:
        """Each slice of an allocation (the first ``slices`` where the caller knows how many), as its accounting
        files say. Blocks (a few system calls per slice)."""
        if not _ALLOCATION_ID.fullmatch(allocation):
            return []
        directory = f"{self.allocations}/{allocation}/slice-"
        uses = []
        for index in range(min(slices, MAX_SLICES_READ)):
            use = read_use(f"{directory}{index}.acct", index)
            if use is None:
                break
            uses.append(use)
        return uses

    def existing(self) -> dict[str, list[str]]:
        """Each allocation directory, with the units the daemon recorded it was made for (none for a DRA claim's,
        nor for one an earlier version made, which kept them where the tenant could rewrite them)."""
        found: dict[str, list[str]] = {}
        try:
            entries = list(os.scandir(self.allocations))
        except OSError:
            return found
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            units = read_untrusted(os.path.join(self.records, entry.name), RECORD_LIMIT) or b""
            found[entry.name] = units.decode(errors="replace").split()
        return found

    def edits(self, allocation: str, budgets: Sequence[Budget]) -> ContainerEdits:
        """What a container needs to run under the layer, held to ``budgets``."""
        edits = ContainerEdits(env={
            "GPUPPETTI_VK_SLICES": slices_env(budgets),
            "GPUPPETTI_VK_ACCOUNTING": CONTAINER_ACCOUNTING,
            "GPUPPETTI_LIMITS": "vulkan",
        })
        if (compute := compute_env(budgets)) is not None:
            edits.env["GPUPPETTI_VK_COMPUTE"] = compute
        edits.add_mount(Mount(CONTAINER_MANIFEST, str(self.path / MANIFEST), read_only=True))
        edits.add_mount(Mount(CONTAINER_LIBRARY, str(self.path / LIBRARY), read_only=True))
        edits.add_mount(Mount(CONTAINER_PROBE, str(self.path / PROBE), read_only=True))
        edits.add_mount(Mount(CONTAINER_ACCOUNTING, str(self.allocations / allocation), read_only=False))
        return edits


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
    log.info("slices are enforced through the Vulkan layer in %s", directory)
    if (why := await asyncio.to_thread(layer.why_unbounded)) is None:
        layer = LayerDir(directory, bounded=True)
        log.info("each allocation directory is a tmpfs of its own, sized for its accounting files")
    else:
        log.warning("allocation directories are not bounded: a container can fill the disk of %s through its own: "
                    "%s", directory, why)
    return Enforcement(layer, f"the Vulkan layer in {directory}")
