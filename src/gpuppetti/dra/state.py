"""Preparing and unpreparing claims: the allocation read from the API, container edits, CDI specs, checkpoint."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Protocol

from gpuppetti import cdi
from gpuppetti.config import DraSection
from gpuppetti.dra import opaque
from gpuppetti.dra.checkpoint import COMPLETED, STARTED, Checkpoint, ClaimRecord, PreparedDevice
from gpuppetti.dra.devices import DraDevice, pool_devices
from gpuppetti.edits import container_edits
from gpuppetti.inventory import Inventory
from gpuppetti.model import ContainerEdits, Gpu, Health, Mount, Unit, Vendor
from gpuppetti.quantity import format_quantity, parse_quantity

log = logging.getLogger(__name__)


class ClaimReader(Protocol):
    async def get_claim(self, namespace: str, name: str) -> dict[str, Any]:
        """The ResourceClaim object; raises ClaimNotFound when there is none."""
        ...


class ClaimNotFound(Exception):
    pass


class PrepareError(Exception):
    """Preparing one claim failed; the message goes to the kubelet in that claim's entry."""


@dataclass(frozen=True)
class ClaimRef:
    namespace: str
    uid: str
    name: str


@dataclass(frozen=True)
class _Plan:
    devices: list[PreparedDevice]
    spec: dict[str, Any]
    filename: str


@dataclass(frozen=True)
class _Share:
    device: DraDevice
    gpu: Gpu
    cores: Fraction | None
    memory: int | None
    share_id: str | None


def _share(device: DraDevice, gpu: Gpu, result: Mapping[str, Any]) -> _Share:
    consumed = result.get("consumedCapacity") or {}
    cores: Fraction | None = None
    memory: int | None = None
    if consumed:
        cores = parse_quantity(str(consumed["cores"])) if "cores" in consumed else None
        memory = int(parse_quantity(str(consumed["memory"]))) if "memory" in consumed else None
    else:
        cores = gpu.cores * device.fraction if gpu.cores is not None else None
        memory = int(gpu.memory_bytes * device.fraction) if gpu.memory_bytes is not None else None
    return _Share(device, gpu, cores, memory, result.get("shareID"))


def _sharing_env(shares: list[_Share], config: opaque.GpuConfig) -> str:
    if any(share.share_id for share in shares):
        return "consumable"
    if any(share.device.partitions > 1 for share in shares):
        return "partition"
    return {"TimeSlicing": "time-slicing", "Exclusive": "none", "MPS": "mps"}[config.sharing.strategy]


def request_edits(
    shares: list[_Share], config: opaque.GpuConfig, gpus: Mapping[str, Gpu], claim: ClaimRef
) -> ContainerEdits:
    """The device plugin's edits for these GPUs, plus the share each one gives (cooperative limits)."""
    units = [Unit(id=s.device.name, gpu_id=s.gpu.id, resource="dra", replicas=s.device.partitions,
                  replica=s.device.part if s.device.partitions > 1 else None) for s in shares]
    edits = container_edits(units, gpus)
    edits.env["GPUPPETTI_SHARING"] = _sharing_env(shares, config)
    edits.env["GPUPPETTI_CLAIM"] = claim.uid
    if any(s.cores is not None for s in shares):
        edits.env["GPUPPETTI_CORES"] = ",".join(format_quantity(s.cores) if s.cores is not None else ""
                                                 for s in shares)
    if any(s.memory is not None for s in shares):
        edits.env["GPUPPETTI_MEMORY"] = ",".join(str(s.memory) if s.memory is not None else "" for s in shares)
    share_ids = [s.share_id for s in shares if s.share_id]
    if share_ids:
        edits.env["GPUPPETTI_SHARE_ID"] = ",".join(share_ids)
    # Nothing in user space enforces these shares on every GPU; say so instead of implying isolation.
    edits.env["GPUPPETTI_LIMITS"] = "cooperative"
    nvidia = [s for s in shares if s.gpu.vendor is Vendor.NVIDIA and s.gpu.backend != "simulated"]
    mps = config.sharing.mps or opaque.MpsConfig()
    if config.sharing.strategy == "MPS" and nvidia:
        percentage = mps.active_thread_percentage
        if percentage is None and nvidia[0].cores is not None and nvidia[0].gpu.cores:
            percentage = max(1, int(100 * nvidia[0].cores / nvidia[0].gpu.cores))
        if percentage is not None:
            edits.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage)
        limits = []
        for position, share in enumerate(nvidia):
            limit = mps.pinned_device_memory_limit or share.memory
            if limit:
                limits.append(f"{position}={max(1, limit // 2**20)}M")
        if limits:
            edits.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(limits)
        edits.env["CUDA_MPS_PIPE_DIRECTORY"] = mps.pipe_directory
        edits.add_mount(Mount(container_path=mps.pipe_directory, host_path=mps.pipe_directory, read_only=False))
    return edits


def _cannot_honour(config: opaque.GpuConfig, share: _Share) -> str | None:
    """Why ``config``'s strategy cannot be what ``share`` gets; None when it can. Running the pod anyway would
    promise what nobody delivers."""
    strategy = config.sharing.strategy
    if strategy == "Exclusive" and share.share_id:
        return "in consumable mode the device shares its capacity with other claims (dra.slicing: whole gives " \
               "a claim the GPU to itself)"
    if strategy == "Exclusive" and share.device.partitions > 1:
        return "a partition shares its GPU with the other partitions (dra.slicing: whole gives a claim the GPU " \
               "to itself)"
    if strategy == "MPS" and share.gpu.vendor is not Vendor.NVIDIA:
        return f"MPS is NVIDIA's Multi-Process Service, and this GPU is {share.gpu.vendor.value}"
    return None


class DraState:
    """Prepare and unprepare, serialised: the kubelet may repeat either call at any time."""

    def __init__(
        self, inventory: Inventory, node: str, cdi_dir: Path, checkpoint: Checkpoint, claims: ClaimReader,
        kind: str = cdi.DEFAULT_KIND,
    ) -> None:
        self._inventory = inventory
        self.node = node
        self.cdi_dir = cdi_dir
        self.checkpoint = checkpoint
        self._claims = claims
        self.kind = kind
        self._lock = asyncio.Lock()
        self._devices_cache: dict[str, DraDevice] = {}
        self._devices_for = -1

    @property
    def section(self) -> DraSection:
        return self._inventory.config.dra

    def restore(self) -> int:
        """Re-create the missing CDI specs of completed claims: /var/run/cdi is tmpfs, and a reboot empties it.

        Only claims the checkpoint still holds count: a spec the driver removed itself (Unprepare) is not missed.
        """
        restored = 0
        for record in self.checkpoint.claims.values():
            if record.state == COMPLETED and record.cdi_spec and record.cdi_file:
                if (self.cdi_dir / record.cdi_file).exists():
                    continue
                cdi.write_spec(self.cdi_dir, record.cdi_file, record.cdi_spec)
                restored += 1
        return restored

    async def prepare(self, claims: Sequence[ClaimRef]) -> dict[str, list[PreparedDevice] | PrepareError]:
        """Prepare every claim of one kubelet call; each gets its devices or its own error.

        The checkpoint is written twice per call, however many claims it holds: once with every new claim
        PrepareStarted (before any side effect), once with them PrepareCompleted (after their CDI specs).
        """
        async with self._lock:
            answers: dict[str, list[PreparedDevice] | PrepareError] = {}
            pending: list[ClaimRef] = []
            for claim in claims:
                record = self.checkpoint.claims.get(claim.uid)
                if record is not None and record.state == COMPLETED:
                    if record.cdi_spec and record.cdi_file and not (self.cdi_dir / record.cdi_file).exists():
                        cdi.write_spec(self.cdi_dir, record.cdi_file, record.cdi_spec)
                    answers[claim.uid] = record.devices
                else:
                    pending.append(claim)
            began = time.perf_counter()
            objects = await asyncio.gather(*(self._read(claim) for claim in pending), return_exceptions=True)
            read = time.perf_counter()
            planned: list[tuple[ClaimRef, _Plan]] = []
            for claim, obj in zip(pending, objects, strict=True):
                if isinstance(obj, PrepareError):
                    answers[claim.uid] = obj
                    continue
                if isinstance(obj, BaseException):
                    # The API server failing for one claim must not fail the others.
                    answers[claim.uid] = PrepareError(
                        f"reading ResourceClaim {claim.namespace}/{claim.name} failed: {obj}")
                    continue
                try:
                    planned.append((claim, self._plan(claim, obj)))
                except PrepareError as exc:
                    answers[claim.uid] = exc
            if not planned:
                return answers
            for claim, _ in planned:
                self.checkpoint.claims[claim.uid] = ClaimRecord(claim.uid, claim.namespace, claim.name, STARTED)
            self.checkpoint.save()
            for claim, plan in planned:
                try:
                    cdi.write_spec(self.cdi_dir, plan.filename, plan.spec)
                except OSError as exc:
                    del self.checkpoint.claims[claim.uid]
                    answers[claim.uid] = PrepareError(f"writing the CDI spec into {self.cdi_dir} failed: {exc}")
                    continue
                self.checkpoint.claims[claim.uid] = ClaimRecord(
                    claim.uid, claim.namespace, claim.name, COMPLETED, plan.devices, plan.spec, plan.filename
                )
                answers[claim.uid] = plan.devices
                log.info("prepared claim %s/%s (%s): %s", claim.namespace, claim.name, claim.uid,
                         ", ".join(d.device for d in plan.devices))
            self.checkpoint.save()
            log.debug("prepared %d claim(s): reading them took %.1f ms, the rest %.1f ms", len(planned),
                      (read - began) * 1000, (time.perf_counter() - read) * 1000)
            return answers

    async def _read(self, claim: ClaimRef) -> dict[str, Any]:
        try:
            return await self._claims.get_claim(claim.namespace, claim.name)
        except ClaimNotFound as exc:
            raise PrepareError(f"ResourceClaim {claim.namespace}/{claim.name} not found: {exc}") from exc

    def _plan(self, claim: ClaimRef, obj: dict[str, Any]) -> _Plan:
        """Everything Prepare will do for ``claim``, computed before anything is written."""
        driver = self.section.driver_name
        uid = (obj.get("metadata") or {}).get("uid")
        if uid != claim.uid:
            raise PrepareError(f"ResourceClaim {claim.namespace}/{claim.name} was replaced: its uid is {uid}, "
                               f"the kubelet asked for {claim.uid}")
        allocation = (obj.get("status") or {}).get("allocation")
        if not allocation:
            raise PrepareError(f"ResourceClaim {claim.namespace}/{claim.name} is not allocated")
        results = [r for r in (allocation.get("devices") or {}).get("results") or [] if r.get("driver") == driver]
        if not results:
            raise PrepareError(f"ResourceClaim {claim.namespace}/{claim.name} has no devices of driver {driver}")

        gpus = self._inventory.gpus
        devices = self._devices()
        by_request: dict[str, list[_Share]] = {}
        problems: list[str] = []
        for result in results:
            name = str(result.get("device"))
            if result.get("pool") != self.node:
                problems.append(f"device {name} is in pool {result.get('pool')!r}, not this node's {self.node!r}")
                continue
            device = devices.get(name)
            if device is None:
                problems.append(f"device {name} is not published by this node")
                continue
            gpu = gpus[device.gpu_id]
            if gpu.health is not Health.HEALTHY:
                problems.append(f"device {name} ({gpu.id}) is {gpu.health}")
                continue
            request = str(result.get("request", "")).split("/", 1)[0]
            by_request.setdefault(request, []).append(_share(device, gpu, result))
        if problems:
            raise PrepareError("; ".join(problems))

        cdi_devices: list[tuple[str, ContainerEdits]] = []
        prepared: list[PreparedDevice] = []
        for request, shares in by_request.items():
            try:
                config = opaque.config_for_request(allocation, driver, request)
            except opaque.OpaqueConfigError as exc:
                raise PrepareError(str(exc)) from exc
            for share in shares:
                if (why := _cannot_honour(config, share)) is not None:
                    raise PrepareError(f"request {request}: sharing strategy {config.sharing.strategy} cannot be "
                                       f"honoured on device {share.device.name} ({share.gpu.id}): {why}")
            cdi_name = f"claim-{claim.uid}-{request}"
            cdi_devices.append((cdi_name, request_edits(shares, config, gpus, claim)))
            for position, share in enumerate(shares):
                # One CDI device per request carries the edits of all its GPUs, so a container that gets the
                # request sees one consistent env; the others name no CDI device, to avoid applying it twice.
                ids = [cdi.qualified_name(self.kind, cdi_name)] if position == 0 else []
                prepared.append(PreparedDevice([request], self.node, share.device.name, ids, share.share_id))
        return _Plan(prepared, cdi.build_spec(self.kind, cdi_devices), cdi.spec_filename(self.kind, claim.uid))

    def _devices(self) -> dict[str, DraDevice]:
        version = self._inventory.version
        if self._devices_for != version:
            self._devices_cache = pool_devices(self._inventory.gpus, self.section)
            self._devices_for = version
        return self._devices_cache

    async def unprepare(self, claims: Sequence[ClaimRef]) -> None:
        """Forget every claim of one call; a claim that was never prepared is simply not there."""
        async with self._lock:
            forgotten = False
            for claim in claims:
                record = self.checkpoint.claims.pop(claim.uid, None)
                cdi.remove_spec(self.cdi_dir, cdi.spec_filename(self.kind, claim.uid))
                if record is not None:
                    forgotten = True
                    log.info("unprepared claim %s/%s (%s)", claim.namespace, claim.name, claim.uid)
            if forgotten:
                self.checkpoint.save()
