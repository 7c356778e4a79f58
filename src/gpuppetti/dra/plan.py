"""Planning a claim: everything Prepare will do for it (its devices, its CDI spec, the Vulkan layer's directories
with their budgets), computed from the claim and the inventory's snapshot before anything is written. Pure: it
reads and writes nothing, so what it returns can be recorded whole in the checkpoint first."""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from gpuppetti.base.quantity import format_quantity
from gpuppetti.core import cdi
from gpuppetti.core.kubeobjects import ResourceClaim
from gpuppetti.core.model import ContainerEdits, Health
from gpuppetti.dra import opaque
from gpuppetti.kit.draplugin import ClaimRef, PreparedDevice
from gpuppetti.layer.vulkan import LayerDir
from gpuppetti.node.inventory import Snapshot
from gpuppetti.sharing.budgets import Enforce, share_budgets
from gpuppetti.sharing.edits import MpsSettings, claim_edits
from gpuppetti.sharing.limits import ENFORCED_BY_ENV, with_limits
from gpuppetti.sharing.shares import Share, ShareError, cannot_honour, claim_share


class PrepareError(Exception):
    """Preparing one claim failed; the message goes to the kubelet in that claim's entry."""


@dataclass(frozen=True)
class DeviceStatus:
    """What a user is told of one prepared device in its claim's status (``status.devices[].data``): which GPU it
    is, the memory and compute share the container was given of it, and what holds it to them."""

    pool: str
    device: str
    share_id: str | None
    data: dict[str, str]


@dataclass(frozen=True)
class Plan:
    devices: list[PreparedDevice]
    spec: dict[str, Any]
    filename: str
    # The Vulkan layer's directory of each request that gets one, with each GPU's budget.
    allocations: dict[str, list[int]] = field(default_factory=dict)
    # One per prepared device, in their order: for the claim's status, not the checkpoint.
    statuses: list[DeviceStatus] = field(default_factory=list)


def layer_allocation(uid: str, request: str) -> str:
    return f"{LAYER_PREFIX}{uid}-{request}"


LAYER_PREFIX = "dra-"
def plan_claim(claim: ClaimRef, obj: ResourceClaim, snapshot: Snapshot, node: str, kind: str,
               layer: LayerDir | None = None) -> Plan:
    """Everything Prepare will do for ``claim``, computed before anything is written. Raises PrepareError."""
    driver = snapshot.config.dra.driver_name
    where = f"ResourceClaim {claim.namespace}/{claim.name}"
    if obj.metadata.uid != claim.uid:
        raise PrepareError(f"{where} was replaced: its uid is {obj.metadata.uid}, the kubelet asked for {claim.uid}")
    allocation = obj.status.allocation
    if allocation is None:
        raise PrepareError(f"{where} is not allocated")
    results = [r for r in allocation.devices.results if r.driver == driver]
    if not results:
        raise PrepareError(f"{where} has no devices of driver {driver}")

    by_request: dict[str, list[Share]] = {}
    problems: list[str] = []
    for result in results:
        if result.pool != node:
            problems.append(f"device {result.device} is in pool {result.pool!r}, not this node's {node!r}")
            continue
        device = snapshot.pool.devices.get(result.device)
        if device is None:
            problems.append(f"device {result.device} is not published by this node")
            continue
        gpu = snapshot.gpus[device.gpu_id]
        if gpu.health is not Health.HEALTHY:
            problems.append(f"device {result.device} ({gpu.id}) is {gpu.health}")
            continue
        try:
            share = claim_share(device, gpu, result.consumed_capacity, result.share_id)
        except ShareError as exc:
            problems.append(str(exc))
            continue
        by_request.setdefault(result.request.split("/", 1)[0], []).append(share)
    if problems:
        raise PrepareError("; ".join(problems))

    cdi_devices: list[tuple[str, ContainerEdits]] = []
    prepared: list[PreparedDevice] = []
    statuses: list[DeviceStatus] = []
    allocations: dict[str, list[int]] = {}
    enforce = Enforce(snapshot.config.sharing.enforce_memory, snapshot.config.sharing.enforce_compute)
    for request, shares in by_request.items():
        try:
            config = opaque.config_for_request(allocation.devices.config, driver, request)
        except opaque.OpaqueConfigError as exc:
            raise PrepareError(str(exc)) from exc
        strategy = config.sharing.strategy
        for share in shares:
            if (why := cannot_honour(strategy, share)) is not None:
                raise PrepareError(f"request {request}: sharing strategy {strategy} cannot be honoured on device "
                                   f"{share.device.name} ({share.gpu.id}): {why}")
        mps = config.sharing.mps or opaque.NO_MPS
        settings = MpsSettings(mps.active_thread_percentage, mps.pinned_device_memory_limit, mps.pipe_directory)
        cdi_name = f"claim-{claim.uid}-{request}"
        edits = claim_edits(shares, strategy, settings, snapshot.gpus, claim.uid)
        budgets = share_budgets(shares, enforce) if enforce else []
        if budgets and layer is not None:
            # Every container of the claim mounts the request's one directory: they share its budget.
            allocation_id = layer_allocation(claim.uid, request)
            edits.merge(layer.edits(allocation_id, budgets))
            allocations[allocation_id] = [budget.memory for budget in budgets]
        if budgets:
            edits = with_limits(edits, budgets, layer.path if layer is not None else None)
        cdi_devices.append((cdi_name, edits))
        # What holds each of the request's GPUs, as the container is told (a whole GPU: none).
        held = edits.env.get(ENFORCED_BY_ENV, "").split(",")
        for position, share in enumerate(shares):
            # One CDI device per request carries the edits of all its GPUs, so a container that gets the
            # request sees one consistent env; the others name no CDI device, to avoid applying it twice.
            ids = [cdi.qualified_name(kind, cdi_name)] if position == 0 else []
            prepared.append(PreparedDevice([request], node, share.device.name, ids, share.share_id))
            enforced = held[position] if len(held) == len(shares) else "none"
            statuses.append(DeviceStatus(node, share.device.name, share.share_id,
                                         status_data(request, share, enforced)))
    return Plan(prepared, cdi.build_spec(kind, cdi_devices), cdi.spec_filename(kind, claim.uid), allocations,
                statuses)


def status_data(request: str, share: Share, enforced_by: str) -> dict[str, str]:
    """The ``data`` of a prepared device's status entry: strings only, so that ``kubectl get resourceclaim -o
    yaml`` shows them as they are read (the memory as a quantity, the compute share as a percentage)."""
    gpu, size = share.gpu, share.size
    data = {"request": request, "gpu": gpu.id, "model": gpu.model}
    if gpu.uuid:
        data["uuid"] = gpu.uuid
    if size.memory is not None:
        data["memory"] = format_quantity(Fraction(size.memory), binary=True)
    if size.cores is not None:
        data["cores"] = format_quantity(size.cores)
    compute = size.cores / gpu.cores if size.cores is not None and gpu.cores else size.fraction
    data["computeShare"] = f"{float(compute) * 100:.4g}%"
    data["enforcedBy"] = enforced_by
    return data
