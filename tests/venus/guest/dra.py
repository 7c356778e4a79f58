"""Run in the venus guest with the installed package's Python: the cluster around ``gpuppetti dra``, and the
runtime's side of each claim it prepares.

``gpuppetti dra`` (from the installed wheel, the drm backend on the virtio-gpu, the node's config with
``dra: {slicing: consumable}``) runs with the kubelet's default directories, against the tests' API server
stand-in (tests/standins/apiserver.py) and their DRA kubelet stand-in (tests/standins/dra_kubelet.py), both
shipped into the VM beside this script. This script plays the scheduler: it allocates claims on the device the
driver published, with the capacity each takes and a share ID, as the scheduler writes them into a claim's status.
The kubelet stand-in has them prepared; each claim's CDI device (the id the driver answered, looked up in the CDI
specs as a CDI runtime looks it up) is applied as the device plugin's Allocate answers are (guest/runtime.py: a
private mount namespace with the device nodes it names, its bind mounts, its env as the whole environment), and
the project's Vulkan probe runs inside. Then the claims are unprepared, the node is re-sliced (``dra: {slicing:
partitions}``, SIGHUP), a quarter is claimed and run the same way, and the driver is stopped with SIGTERM.

What it saw goes to OUT/dra.json, the containers' runs to OUT/dra-steps.json, the driver's log to OUT/dra.log.

    python dra.py WORK OUT
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

WORK, OUT = Path(sys.argv[1]), Path(sys.argv[2])
STARTED = time.monotonic()
NODE = "venus-node"
DRIVER = "gpu.gpuppetti.dev"
API_HOST, API_PORT = "127.0.0.1", 6443
# The driver's defaults (the kubelet's directories, /var/run/cdi, the Vulkan layer's directory, which the device
# plugin beside it shares), on the guest's own file systems.
REGISTRY = Path("/var/lib/kubelet/plugins_registry")
PLUGINS = Path("/var/lib/kubelet/plugins")
CDI_DIR = Path("/var/run/cdi")
LAYER_ALLOCATIONS = Path("/var/lib/gpuppetti/vulkan/ledgers")
CONFIG = Path("/run/gpuppetti-dra/dra.yaml")
KUBECONFIG = Path("/run/gpuppetti-dra/kubeconfig")


def start_driver() -> subprocess.Popen[bytes]:
    """``gpuppetti dra``, started before this script's own imports: each takes seconds on an emulated CPU."""
    CONFIG.parent.mkdir(parents=True, exist_ok=True)
    CONFIG.write_text((WORK / "dra-consumable.yaml").read_text())
    KUBECONFIG.write_text(json.dumps({
        "apiVersion": "v1", "kind": "Config", "current-context": "standin",
        "clusters": [{"name": "standin", "cluster": {"server": f"http://{API_HOST}:{API_PORT}"}}],
        "contexts": [{"name": "standin", "context": {"cluster": "standin", "user": "standin"}}],
        "users": [{"name": "standin", "user": {}}],
    }))
    log = (OUT / "dra.log").open("wb")
    return subprocess.Popen(["gpuppetti", "dra", "--config", str(CONFIG), "--node-name", NODE, "--kubeconfig",
                             str(KUBECONFIG), "--http-address", "", "--log-level", "info"],
                            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


DRA = start_driver()

import asyncio  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb  # noqa: E402
from tests.standins.apiserver import ApiStandIn  # noqa: E402
from tests.standins.dra_kubelet import ClaimKey, DraKubelet  # noqa: E402

if TYPE_CHECKING:
    from tests.venus.guest.runtime import VENUS_ICD, Steps
else:
    # In the guest, guest/runtime.py is beside this script.
    from runtime import VENUS_ICD, Steps

# A run that outlasts this is killed and run once more (a Venus ring on this stand-in now and then stops moving).
STEP_TIMEOUT_S = 120.0
# The containers run as in an image with Venus alone: that ring has stopped only in processes that also loaded the
# guest's own lavapipe (guest/driver.py says more), and these run beside the device plugin's last workload.
ALONE = {"VK_DRIVER_FILES": VENUS_ICD}


class Seen:
    """What the runner saw, saved to OUT/dra.json after every change (a failure halfway leaves what came before)."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"timeline": []}

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def mark(self, what: str) -> None:
        self.data["timeline"].append([what, round(time.monotonic() - STARTED, 2)])
        self.save()

    def save(self) -> None:
        (OUT / "dra.json.tmp").write_text(json.dumps(self.data, indent=1))
        (OUT / "dra.json.tmp").rename(OUT / "dra.json")


async def until(what: str, predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if DRA.poll() is not None:
            raise RuntimeError(f"gpuppetti dra exited {DRA.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} after {timeout:.0f}s")
        await asyncio.sleep(0.2)


async def allocate(api: ApiStandIn, name: str, device: str, share_id: str, consumed: dict[str, str]) -> ClaimKey:
    """Play the scheduler: a claim, then its allocation (the device, the share ID, the capacity it consumes)
    written into its status."""
    claim = await api.create("resourceclaims", {
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name, "namespace": "default"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
    }, "default")
    claim["status"] = {
        "allocation": {"devices": {"results": [{"driver": DRIVER, "pool": NODE, "request": "gpu", "device": device,
                                                "shareID": share_id, "consumedCapacity": consumed}],
                                   "config": []}},
        "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": f"{name}-pod-uid"}],
    }
    claim = await api.update("resourceclaims", claim, "default", status=True)
    return ClaimKey("default", name, claim["metadata"]["uid"])


def cdi_devices() -> dict[str, dict[str, Any]]:
    """Every CDI device in the CDI directory, by its qualified name, with the spec's own edits first: what a CDI
    runtime finds for a name."""
    found = {}
    for path in sorted(CDI_DIR.glob("*.json")):
        spec = json.loads(path.read_text())
        for device in spec["devices"]:
            found[f"{spec['kind']}={device['name']}"] = {"file": path.name, "spec": spec,
                                                         "edits": [spec.get("containerEdits", {}),
                                                                   device["containerEdits"]]}
    return found


def cdi_response(device: dict[str, Any]) -> pb.ContainerAllocateResponse:
    """A CDI device's edits in the words guest/runtime.py applies: device nodes, mounts, env."""
    response = pb.ContainerAllocateResponse()
    for edits in device["edits"]:
        for line in edits.get("env", []):
            key, _, value = line.partition("=")
            response.envs[key] = value
        for node in edits.get("deviceNodes", []):
            response.devices.append(pb.DeviceSpec(container_path=node["path"], host_path=node.get("hostPath",
                                                                                                  node["path"]),
                                                  permissions=node.get("permissions", "rwm")))
        for mount in edits.get("mounts", []):
            response.mounts.append(pb.Mount(container_path=mount["containerPath"], host_path=mount["hostPath"],
                                            read_only="ro" in mount.get("options", [])))
    return response


def answers(prepared: dict[str, Any]) -> dict[str, Any]:
    return {uid: {"error": entry.error,
                  "devices": [{"pool": d.pool_name, "device": d.device_name, "requests": list(d.request_names),
                               "cdi": list(d.cdi_device_ids), "share_id": d.share_id} for d in entry.devices]}
            for uid, entry in prepared.items()}


async def prepare_and_run(api: ApiStandIn, kubelet: DraKubelet, steps: Steps, seen: Seen, phase: str,
                          claims: dict[str, ClaimKey], refused: dict[str, ClaimKey]) -> None:
    """Have the claims prepared, run the probe in a container given each one's CDI device, unprepare them."""
    everything = {**claims, **refused}
    prepared = (await kubelet.prepare(list(everything.values())))[DRIVER]
    seen[f"{phase}-claims"] = {name: {"uid": key.uid, "object": api.get("resourceclaims", key.name, key.namespace)}
                               for name, key in everything.items()}
    seen[f"{phase}-prepared"] = {name: answers(prepared)[key.uid] for name, key in everything.items()}
    seen.mark(f"{phase} prepared")
    found = cdi_devices()
    seen[f"{phase}-cdi"] = {name: {"file": found[cdi]["file"], "spec": found[cdi]["spec"]}
                            for name, key in claims.items() for cdi in prepared[key.uid].devices[0].cdi_device_ids}
    seen[f"{phase}-layer-before"] = sorted(p.name for p in LAYER_ALLOCATIONS.iterdir() if p.name.startswith("dra-"))
    for name, key in claims.items():
        [cdi] = prepared[key.uid].devices[0].cdi_device_ids
        await steps.run(f"{phase}-{name}", cdi_response(found[cdi]),
                        ["sh", "-c", "ls /dev/dri; exec gpuppetti-vkinfo --json --allocate 64"], ALONE,
                        timeout=STEP_TIMEOUT_S, attempts=2)
    seen.mark(f"{phase} ran")
    gone = (await kubelet.unprepare(list(everything.values()), [DRIVER]))[DRIVER]
    seen[f"{phase}-unprepared"] = {name: gone[key.uid].error for name, key in everything.items()}
    seen[f"{phase}-cdi-after"] = sorted(path.name for path in CDI_DIR.glob("*.json"))
    seen[f"{phase}-layer-after"] = sorted(p.name for p in LAYER_ALLOCATIONS.iterdir() if p.name.startswith("dra-"))


def devices_of(api: ApiStandIn) -> list[dict[str, Any]]:
    return [device for body in api.list("resourceslices") for device in body["spec"].get("devices", [])]


async def main() -> int:
    seen = Seen()
    seen.mark("imported")
    steps = Steps(OUT, "dra-steps.json")
    api = ApiStandIn()
    await api.start(API_HOST, API_PORT)
    await api.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
    kubelet = DraKubelet(REGISTRY, api, NODE)
    await kubelet.start()
    try:
        plugin = await kubelet.wait_registered(DRIVER, timeout=240)
        seen["registration"] = {"service": plugin.service, "endpoint": plugin.endpoint}
        seen.mark("registered")
        await until("ResourceSlice", lambda: devices_of(api), 120)
        seen["consumable-slices"] = api.list("resourceslices")
        seen.mark("published")
        [device] = devices_of(api)
        claims = {
            "small": await allocate(api, "small", device["name"], "a1b2c3",
                                    {"share": "1m", "cores": "10", "memory": "384Mi"}),
            "large": await allocate(api, "large", device["name"], "d4e5f6",
                                    {"share": "1m", "cores": "20", "memory": "1Gi"}),
        }
        await prepare_and_run(api, kubelet, steps, seen, "consumable", claims, {})

        # The node re-sliced: its config's dra section changed, then SIGHUP, as a ConfigMap's update is applied.
        CONFIG.write_text((WORK / "dra-partitions.yaml").read_text())
        DRA.send_signal(signal.SIGHUP)
        await until("partitions' ResourceSlice",
                    lambda: any("validValues" in d["capacity"]["memory"].get("requestPolicy", {})
                                for d in devices_of(api)), 120)
        seen["partitions-slices"] = api.list("resourceslices")
        seen.mark("re-sliced")
        [device] = devices_of(api)
        quarter = await allocate(api, "quarter", device["name"], "a7b8c9", {"memory": "512Mi"})
        odd = await allocate(api, "odd", device["name"], "f0e1d2", {"memory": "640Mi"})
        await prepare_and_run(api, kubelet, steps, seen, "partitions", {"quarter": quarter}, {"odd": odd})
    finally:
        if DRA.poll() is None:
            DRA.send_signal(signal.SIGTERM)
        try:
            code = await asyncio.to_thread(DRA.wait, 60)
        except subprocess.TimeoutExpired:
            DRA.kill()
            code = await asyncio.to_thread(DRA.wait)
        seen["driver-exit"] = code
        seen["sockets-after"] = sorted(str(path) for directory in (REGISTRY, PLUGINS / DRIVER)
                                       for path in directory.glob("*.sock"))
        await kubelet.stop()
        await api.stop()
        # The guest's CPU time this scenario took (the VM's CPUs are emulated, and shared with the node's others).
        seen["cpu-seconds"] = {who: round(usage.ru_utime + usage.ru_stime, 2) for who, usage in (
            ("runner", resource.getrusage(resource.RUSAGE_SELF)),
            ("driver and containers", resource.getrusage(resource.RUSAGE_CHILDREN)))}
        seen.mark("stopped")
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    sys.exit(asyncio.run(main()))
