"""DRA at cluster scale: `make bench-scale` (or `python bench/scale.py --nodes 50,200 --json out.json`).

A real API server and scheduler (the shared real-node kit) with N simulated nodes: Node objects made Ready by
hand, with no kubelet, each given the ResourceSlices the DRA driver's own code publishes for 8 simulated
48Gi/40-core GPUs. Then, per slicing shape, one pre-created ResourceClaim per pod as the project's examples ask
(a whole GPU, a quarter of one, or 10 cores and 12Gi of one), pods that tolerate every taint and select the
simulated nodes, and the time and the scheduler's CPU it takes to bind them all. Each shape and size runs on a
fresh cluster, so that the API server's memory is that shape's.

The scheduler's client QPS is raised (--scheduler-qps, 5000 by default) so that the allocator sets the pace, not
the scheduler's rate limit toward the API server; --scheduler-qps 0 keeps its defaults (50/100).
A shape that cannot bind its pods within --budget seconds is reported with how many it bound, not waited for.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from rich.console import Console

from gpuppetti.base.tables import Column, print_table
from gpuppetti.core.config import parse_config
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.dra.slices import pool_content
from gpuppetti.kit.publisher import resource_slices
from gpuppetti.node.inventory import Inventory
from tests.cluster.realnode import KIT, RealNode, machine_lock, why_not

REPO = Path(__file__).resolve().parents[1]
STATE_DIR = Path(os.environ.get("GPUPPETTI_SCALE_DIR", "/tmp/gpuppetti-scale-bench"))
DRIVER = "gpu.gpuppetti.dev"
GPUS_PER_NODE = 8
BENCH_LABEL = "bench.gpuppetti.dev/simulated"
NAMESPACE = "default"
CONCURRENCY = 48
SCHEDULER_HEALTH = "https://127.0.0.1:10259/healthz"


@dataclass(frozen=True)
class Shape:
    name: str
    dra: str  # the config's dra section, in flow style
    request: dict[str, Any]  # the claim's one request, `exactly`
    about: str
    # The study's shapes only: what is taken out of the driver's slices, to see what the rest costs.
    edit: Callable[[list[dict[str, Any]]], list[dict[str, Any]]] | None = None


WHOLE_CEL = ("!('partitions' in device.attributes['gpu.gpuppetti.dev']) || "
             "device.attributes['gpu.gpuppetti.dev'].partitions == 1")
SHAPES: dict[str, Shape] = {shape.name: shape for shape in (
    Shape("whole", "{slicing: whole}",
          {"deviceClassName": "gpu.gpuppetti.dev", "selectors": [{"cel": {"expression": WHOLE_CEL}}]},
          "a whole GPU"),
    Shape("consumable", "{slicing: consumable}",
          {"deviceClassName": "gpu.gpuppetti.dev", "capacity": {"requests": {"cores": "10", "memory": "12Gi"}}},
          "10 cores and 12Gi of a GPU"),
    Shape("partitions", "{slicing: partitions, partitions: [2, 4, 8]}",
          {"deviceClassName": "partition.gpu.gpuppetti.dev", "capacity": {"requests": {"memory": "12Gi"}}},
          "a quarter partition (12Gi of 48Gi), partitions [2, 4, 8] in the capacity layout"),
    Shape("partitions-counters", "{slicing: partitions, partitions: [2, 4, 8], partitionLayout: counters}",
          {"deviceClassName": "partition.gpu.gpuppetti.dev",
           "selectors": [{"cel": {"expression": "device.attributes['gpu.gpuppetti.dev'].partitions == 4"}}]},
          "a quarter partition, partitions [2, 4, 8] in the counters layout"),
)}


def _recount(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kept = [s for s in slices if s["spec"].get("devices") or s["spec"].get("sharedCounters")]
    for body in kept:
        body["spec"]["pool"] = {**body["spec"]["pool"], "resourceSliceCount": len(kept)}
    return kept


def _without_counters(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    kept = [s for s in slices if "sharedCounters" not in s["spec"]]
    for body in kept:
        body["spec"]["devices"] = [{k: v for k, v in d.items() if k != "consumesCounters"}
                                   for d in body["spec"]["devices"]]
    return _recount(kept)


def _whole_devices_only(slices: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for body in slices:
        if "devices" in body["spec"]:
            body["spec"]["devices"] = [d for d in body["spec"]["devices"] if "partition" not in d["attributes"]]
    return _recount(slices)


# Where the counters layout's cost comes from (docs/scale.md): its shape with one thing taken out at a time.
QUARTER_CEL = [{"cel": {"expression": "device.attributes['gpu.gpuppetti.dev'].partitions == 4"}}]
COUNTERS = "{slicing: partitions, partitions: [2, 4, 8], partitionLayout: counters}"
STUDY: dict[str, Shape] = {shape.name: shape for shape in (
    Shape("study-counters-8-devices", COUNTERS, SHAPES["whole"].request,
          "a whole GPU, of 8 whole-GPU devices that consume counters", _whole_devices_only),
    Shape("study-120-devices-no-counters", COUNTERS,
          {"deviceClassName": "partition.gpu.gpuppetti.dev", "selectors": QUARTER_CEL},
          "a quarter partition device, of 120 that consume no counters", _without_counters),
    Shape("study-counters-40-devices", "{slicing: partitions, partitions: [4], partitionLayout: counters}",
          {"deviceClassName": "partition.gpu.gpuppetti.dev", "selectors": QUARTER_CEL},
          "a quarter partition, partitions [4] in the counters layout"),
)}


@dataclass
class Result:
    shape: str
    nodes: int
    pods: int
    bound: int
    seconds: float
    pods_per_s: float
    scheduler_cpu_ms_per_pod: float | None
    devices_per_node: int
    slices_per_node: int
    slice_bytes_per_node: int
    apiserver_rss_mib: float
    scheduler_qps: int
    detail: dict[str, Any] = field(default_factory=dict)


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def node_slices(shape: Shape, node: str) -> list[dict[str, Any]]:
    """What `gpuppetti dra` publishes for this node, from its own code."""
    config = parse_config(
        "version: v1\nbackend: simulated\nsimulated:\n  gpus: [{model: Apple M3 Max, vendor: apple, cores: 40, "
        f"memory: 48Gi, count: {GPUS_PER_NODE}}}]\ndra: {shape.dra}\n", "bench")
    snapshot = Inventory(config, SimulatedBackend(config.simulated).discover()).snapshot
    slices: list[dict[str, Any]] = json.loads(json.dumps(
        resource_slices(pool_content(snapshot, node), node, DRIVER, 1, None)))
    return shape.edit(slices) if shape.edit else slices


def compact(body: Any) -> int:
    return len(json.dumps(body, separators=(",", ":")))


def device_classes() -> list[dict[str, Any]]:
    objects = yaml.safe_load_all((REPO / "deploy/base/dra/resources.yaml").read_text())
    return [o for o in objects if o and o.get("kind") == "DeviceClass"]


class Api:
    """The few REST calls the bench makes, as the cluster's admin, over one connection pool."""

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.base = "https://127.0.0.1:16443"
        self.session = session
        self.limit = asyncio.Semaphore(CONCURRENCY)

    @staticmethod
    def tls(state: Path) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(state / "pki/ca.crt"))
        context.load_cert_chain(str(state / "pki/admin.crt"), str(state / "pki/admin.key"))
        return context

    async def call(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        async with self.limit:
            for attempt in range(20):
                async with self.session.request(method, self.base + path, data=json.dumps(body) if body else None,
                                                headers={"Content-Type": content_type}) as response:
                    if response.status == 429 or response.status >= 500:
                        await asyncio.sleep(0.2 * (attempt + 1))
                        continue
                    text = await response.text()
                    if response.status >= 300:
                        raise RuntimeError(f"{method} {path}: {response.status} {text[:300]}")
                    return json.loads(text)
            raise RuntimeError(f"{method} {path}: still refused after 20 tries")

    async def create_all(self, path: str, bodies: Iterable[Any]) -> None:
        async with asyncio.TaskGroup() as group:
            for body in bodies:
                group.create_task(self.call("POST", path, body))

    async def watch_bindings(self, bound: dict[str, float], total: int, done: asyncio.Event) -> None:
        """Record when each pod is bound to a node: a list, then a watch from the list's resourceVersion, again
        whenever the watch ends or says it cannot serve (this API server's watch cache can lag etcd)."""
        pods = f"{self.base}/api/v1/namespaces/{NAMESPACE}/pods"
        while len(bound) < total:
            listed = await self.call("GET", pods.removeprefix(self.base))
            for item in listed["items"]:
                self._saw(item, bound)
            version = listed["metadata"]["resourceVersion"]
            async with self.session.get(f"{pods}?watch=1&resourceVersion={version}",
                                        timeout=aiohttp.ClientTimeout(total=None)) as response:
                async for line in response.content:
                    event = json.loads(line)
                    if event.get("type") == "ERROR":
                        break
                    self._saw(event["object"], bound)
                    if len(bound) >= total:
                        break
        done.set()

    @staticmethod
    def _saw(pod: dict[str, Any], bound: dict[str, float]) -> None:
        if pod.get("spec", {}).get("nodeName"):
            bound.setdefault(pod["metadata"]["name"], time.monotonic())


def fake_node(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    node = {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {BENCH_LABEL: "true", "kubernetes.io/hostname": name}},
            "spec": {"taints": [{"key": BENCH_LABEL, "value": "true", "effect": "NoSchedule"}]}}
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    status = {"status": {
        "capacity": {"cpu": "64", "memory": "256Gi", "pods": "110"},
        "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "110"},
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "simulated",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}]}}
    return node, status


def claim(name: str, shape: Shape) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": shape.request}]}}}


def pod(name: str, claim_name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"nodeSelector": {BENCH_LABEL: "true"}, "tolerations": [{"operator": "Exists"}],
                     "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "c", "image": "localhost/busybox:1.36",
                                     "resources": {"claims": [{"name": "gpu"}]}}],
                     "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}]}}


def raise_scheduler_qps(node: RealNode, qps: int) -> None:
    if qps <= 0:
        return
    command = node.dir / "run" / "kube-scheduler.cmd"
    command.write_text(command.read_text().rstrip() + f" --kube-api-qps={qps} --kube-api-burst={qps}")
    node.ctl("restart", "kube-scheduler")
    # Its own health endpoint (always allowed without credentials), not the API server's.
    unverified = ssl.create_default_context()
    unverified.check_hostname, unverified.verify_mode = False, ssl.CERT_NONE
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(SCHEDULER_HEALTH, context=unverified, timeout=5) as answer:
                if answer.read() == b"ok":
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler did not come back ({SCHEDULER_HEALTH})")
        time.sleep(0.5)


def pid_of(node: RealNode, name: str) -> int:
    return int(node.ctl("pid", name).stdout.strip())


@contextlib.asynccontextmanager
async def api_session(state: Path) -> AsyncIterator[Api]:
    connector = aiohttp.TCPConnector(ssl=Api.tls(state), limit=CONCURRENCY)
    async with aiohttp.ClientSession(connector=connector) as session:
        yield Api(session)


def step(text: str) -> None:
    print(f"  {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


async def run_one(node: RealNode, shape: Shape, nodes: int, pods_per_node: int, budget: float,
                  qps: int) -> Result:
    names = [f"sim-{i:04d}" for i in range(nodes)]
    pods = nodes * pods_per_node
    sample = node_slices(shape, names[0])
    devices = sum(len(s["spec"].get("devices", [])) for s in sample)
    async with api_session(node.dir) as api:
        step("device classes")
        await api.create_all("/apis/resource.k8s.io/v1/deviceclasses", device_classes())
        step(f"{nodes} simulated nodes, Ready")
        made = [fake_node(name) for name in names]
        await api.create_all("/api/v1/nodes", (body for body, _ in made))
        async with asyncio.TaskGroup() as group:
            for name, (_, status) in zip(names, made, strict=True):
                group.create_task(api.call("PATCH", f"/api/v1/nodes/{name}/status", status,
                                           "application/merge-patch+json"))
        step(f"their ResourceSlices ({len(sample)} per node, {devices} devices)")
        await api.create_all("/apis/resource.k8s.io/v1/resourceslices",
                             (body for name in names for body in node_slices(shape, name)))
        step(f"{pods} ResourceClaims ({shape.about})")
        await api.create_all(f"/apis/resource.k8s.io/v1/namespaces/{NAMESPACE}/resourceclaims",
                             (claim(f"claim-{i}", shape) for i in range(pods)))
        # Let the scheduler's informers take in the nodes, slices and claims before its CPU is counted.
        await asyncio.sleep(5)
        scheduler = pid_of(node, "kube-scheduler")
        cpu_before = _cpu_seconds(scheduler)
        bound: dict[str, float] = {}
        done = asyncio.Event()
        step(f"{pods} pods; waiting up to {budget:.0f} s for the scheduler to bind them")
        started = time.monotonic()
        async with asyncio.TaskGroup() as group:
            watcher = group.create_task(api.watch_bindings(bound, pods, done), name="watch bindings")
            await asyncio.sleep(0.5)  # the watch is open before the first pod is created
            started = time.monotonic()
            await api.create_all(f"/api/v1/namespaces/{NAMESPACE}/pods",
                                 (pod(f"pod-{i}", f"claim-{i}") for i in range(pods)))
            created = time.monotonic() - started
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), max(0.0, budget - (time.monotonic() - started)))
            watcher.cancel()
        cpu = _cpu_seconds(scheduler) - cpu_before
        last = max(bound.values(), default=started)
        seconds = last - started if len(bound) == pods else time.monotonic() - started
        rss = _rss_mib(pid_of(node, "kube-apiserver"))
    slice_bytes = sum(compact(s) for s in sample)
    return Result(shape.name, nodes, pods, len(bound), round(seconds, 2), round(len(bound) / seconds, 2),
                  round(cpu / len(bound) * 1000, 1) if bound else None, devices, len(sample), slice_bytes,
                  round(rss), qps, {"pods_created_s": round(created, 2), "scheduler_cpu_s": round(cpu, 2)})


def show(results: list[Result], title: str) -> None:
    columns = [Column("shape"), Column("nodes", justify="right"), Column("bound", justify="right"),
               Column("pods/s", justify="right"), Column("sched CPU/pod", justify="right"),
               Column("devices/node", rank=2, justify="right"), Column("slice KB/node", rank=2, justify="right"),
               Column("API RSS MiB", rank=1, justify="right")]
    rows = [[r.shape, str(r.nodes), f"{r.bound}/{r.pods}", f"{r.pods_per_s:g}",
             f"{r.scheduler_cpu_ms_per_pod:g} ms" if r.scheduler_cpu_ms_per_pod is not None else "-",
             str(r.devices_per_node), f"{r.slice_bytes_per_node / 1000:.1f}", f"{r.apiserver_rss_mib:g}"]
            for r in results]
    print_table(Console(), title, columns, rows)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bench/scale.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", default="50,200,500", help="simulated node counts, comma-separated")
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help=f"of {', '.join(SHAPES)}; and the study's: {', '.join(STUDY)}")
    parser.add_argument("--pods-per-node", type=int, default=4)
    parser.add_argument("--budget", type=float, default=90.0, help="seconds a shape gets to bind its pods")
    parser.add_argument("--scheduler-qps", type=int, default=5000, help="0 keeps the scheduler's defaults")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument("--keep", action="store_true",
                        help="leave the last cluster up for a look (REALNODE_DIR=$GPUPPETTI_SCALE_DIR down.sh "
                        "takes it down)")
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.node_counts = [int(n) for n in args.nodes.split(",")]
    except ValueError:
        parser.error(f"--nodes: not a list of numbers: {args.nodes!r}")
    args.shape_list = [s for s in args.shapes.split(",") if s]
    for name in args.shape_list:
        if name not in SHAPES and name not in STUDY:
            parser.error(f"--shapes: no shape {name!r} (known: {', '.join([*SHAPES, *STUDY])})")
    return args


def main(argv: list[str] | None = None, run: Callable[..., Any] = asyncio.run) -> int:
    args = parse_args(argv)
    reason = why_not()
    if reason is not None:
        print(f"bench-scale skipped: {reason}", file=sys.stderr)
        return 0
    results: list[Result] = []
    node = RealNode(STATE_DIR, KIT)
    with machine_lock():
        for count in args.node_counts:
            for name in args.shape_list:
                print(f"{name} at {count} nodes", file=sys.stderr, flush=True)
                try:
                    node.up()
                    raise_scheduler_qps(node, args.scheduler_qps)
                    results.append(run(run_one(node, {**SHAPES, **STUDY}[name], count, args.pods_per_node, args.budget,
                                               args.scheduler_qps)))
                finally:
                    if not (args.keep and (count, name) == (args.node_counts[-1], args.shape_list[-1])):
                        node.down()
                show(results[-1:], f"{name} at {count} nodes")
                if args.json:
                    # After each run: a long bench stopped half-way keeps what it measured.
                    args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")
    show(results, f"DRA at cluster scale (scheduler QPS {args.scheduler_qps or 'default'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
