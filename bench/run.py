"""The gpuppetti benchmark suite: `make bench` (or `python bench/run.py --json results.json`).

The plugin and the DRA driver run as real subprocesses; the built-in kubelet emulator (and API stand-in) play
the kubelet in this process, through real Unix sockets. Every latency is taken in the same run as its baseline,
so a noisy machine moves both. See bench/README.md for what each figure means.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from gpuppetti._proto.deviceplugin.v1beta1 import api_pb2 as pb
from gpuppetti.config import parse_config
from gpuppetti.discovery.simulated import SimulatedBackend
from gpuppetti.inventory import Inventory
from gpuppetti.kubelet.emulator import KubeletEmulator
from gpuppetti.model import Health
from tests.standins.apiserver import ApiStandIn
from tests.standins.dra_kubelet import ClaimKey, DraKubelet

SIZES = (10, 100, 1000, 10000)
APPLE = "apple.com/gpu"
NODE = "bench-node"
DRIVER = "gpu.gpuppetti.dev"


@dataclass
class Figure:
    name: str
    value: float | None
    unit: str
    goal: str = "report"
    met: bool | None = None
    detail: str = ""


def percentile(samples: Sequence[float], q: float) -> float:
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def plugin_config(units: int, toggled_health: str = "Healthy") -> str:
    """``units`` units: one GPU whose health the benchmark flips, and the rest on other GPUs."""
    replicas = 4 if units <= 8 else 5 if units <= 10 else 10 if units < 1000 else 100
    gpus = max(2, units // replicas)
    return (
        "version: v1\nbackend: simulated\nsimulated:\n  gpus:\n"
        f"    - {{model: Flip, vendor: apple, cores: 40, memory: 48Gi, count: 1, health: {toggled_health}}}\n"
        f"    - {{model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: {gpus - 1}}}\n"
        f"sharing:\n  timeSlicing:\n    resources:\n      - {{name: {APPLE}, replicas: {replicas}}}\n"
    )


class Plugin:
    """``gpuppetti plugin`` as a subprocess serving ``directory``."""

    def __init__(self, workdir: Path, config: str, name: str, directory: Path) -> None:
        self.config = workdir / f"{name}.yaml"
        self.config.write_text(config)
        self.log = (workdir / f"{name}.log").open("wb")
        self.started = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gpuppetti", "plugin", "--config", str(self.config), "--device-plugin-dir",
             str(directory), "--http-address", "", "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


async def bench_plugin_basics(workdir: Path, idle_seconds: float, figures: list[Figure]) -> None:
    (workdir / "dp").mkdir(exist_ok=True)
    async with KubeletEmulator(workdir / "dp") as kubelet:
        starts = []
        for attempt in range(5):
            plugin = Plugin(workdir, plugin_config(8), f"start-{attempt}", workdir / "dp")
            before = kubelet.registrations(APPLE)
            await kubelet.wait_registered(APPLE, count=before + 1, timeout=30)
            starts.append(time.monotonic() - plugin.started)
            if attempt < 4:
                plugin.stop()
        figures.append(Figure("process start to registered (median of 5)", statistics.median(starts) * 1000,
                              "ms", "≤ 1500 ms", statistics.median(starts) <= 1.5,
                              f"max {max(starts) * 1000:.0f} ms"))

        await asyncio.sleep(2)
        cpu_before, wall_before = plugin.cpu_seconds(), time.monotonic()
        await asyncio.sleep(idle_seconds)
        cpu = plugin.cpu_seconds() - cpu_before
        share = 100 * cpu / (time.monotonic() - wall_before)
        figures.append(Figure(f"idle CPU over {idle_seconds:.0f} s, 2 GPUs x 4 replicas", share, "% of a core",
                              "≤ 0.2 %", share <= 0.2, f"{cpu * 1000:.0f} ms of CPU"))
        rss = plugin.rss_bytes() / 2**20
        figures.append(Figure("resident memory, 2 GPUs x 4 replicas", rss, "MiB", "≤ 60 MiB", rss <= 60))

        restarts = []
        for _ in range(20):
            count = kubelet.registrations(APPLE)
            began = time.monotonic()
            await kubelet.restart()
            await kubelet.wait_registered(APPLE, count=count + 1, timeout=10)
            restarts.append(time.monotonic() - began)
        p99 = percentile(restarts, 99) * 1000
        figures.append(Figure("kubelet restart to re-registered (p99 of 20)", p99, "ms", "≤ 250 ms", p99 <= 250,
                              f"p50 {percentile(restarts, 50) * 1000:.1f} ms"))
        plugin.stop()


async def bench_size(workdir: Path, units: int, calls: int, figures: list[Figure]) -> None:
    directory = workdir / f"dp-{units}"
    directory.mkdir()
    async with KubeletEmulator(directory) as kubelet:
        plugin = Plugin(workdir, plugin_config(units), f"size-{units}", directory)
        try:
            endpoint = await kubelet.wait_registered(APPLE, timeout=60)
            ids = sorted(endpoint.devices)
            allocate_samples: list[float] = []
            baseline_samples: list[float] = []
            for n in range(calls):
                request = pb.AllocateRequest()
                request.container_requests.add(devices_ids=[ids[(n * 7919) % len(ids)]])
                began = time.perf_counter()
                await endpoint.stub.Allocate(request)
                allocate_samples.append(time.perf_counter() - began)
                # The baseline: a no-op unary call (PreStartContainer) on the same socket, interleaved.
                began = time.perf_counter()
                await endpoint.stub.PreStartContainer(pb.PreStartContainerRequest())
                baseline_samples.append(time.perf_counter() - began)
            a50, b50 = percentile(allocate_samples, 50), percentile(baseline_samples, 50)
            ratio = a50 / b50
            goal = "p50 ratio ≤ 1.25" if units >= 1000 else "report"
            figures.append(Figure(
                f"Allocate p50 / no-op unary p50, {len(ids)} units", ratio, "x", goal,
                ratio <= 1.25 if units >= 1000 else None,
                f"Allocate p50 {a50 * 1e6:.0f} µs p99 {percentile(allocate_samples, 99) * 1e6:.0f} µs; "
                f"no-op p50 {b50 * 1e6:.0f} µs p99 {percentile(baseline_samples, 99) * 1e6:.0f} µs"))

            flips: list[float] = []
            for n in range(20):
                health = "Unhealthy" if n % 2 == 0 else "Healthy"
                seen = endpoint.updates

                def arrived(seen: int = seen) -> bool:
                    return endpoint.updates > seen

                plugin.config.write_text(plugin_config(units, health))
                began = time.monotonic()
                plugin.process.send_signal(signal.SIGHUP)
                await kubelet.wait_for(arrived, timeout=30)
                flips.append(time.monotonic() - began)
            p99 = percentile(flips, 99) * 1000
            figures.append(Figure(f"health change to the kubelet's new list (p99 of 20), {len(ids)} units", p99,
                                  "ms", "p99 ≤ 50 ms" if units <= 1000 else "report",
                                  p99 <= 50 if units <= 1000 else None,
                                  "a SIGHUP reload flips one GPU's health: config parse, discovery, full list"))
        finally:
            plugin.stop()


async def bench_list_building(figures: list[Figure]) -> None:
    for units in SIZES:
        config = parse_config(plugin_config(units), "bench")
        inventory = Inventory(config, SimulatedBackend(config.simulated).discover())
        plan = inventory.plan[APPLE]
        inventory.snapshot.device_list(APPLE)
        samples = []
        for n in range(20):
            # As after a health event: one GPU changed, and the whole list goes to the kubelet again.
            health = Health.UNHEALTHY if n % 2 == 0 else Health.HEALTHY
            await inventory.set_health(plan.units[0].gpu_id, health)
            began = time.perf_counter()
            inventory.snapshot.device_list(APPLE)
            samples.append(time.perf_counter() - began)
        median = statistics.median(samples) * 1000
        figures.append(Figure(f"ListAndWatch list rebuilt after a health change and serialised, "
                              f"{len(plan.units)} units", median, "ms",
                              "≤ 20 ms" if units == 10000 else "report", median <= 20 if units == 10000 else None))


def dra_config(gpus: int) -> str:
    entries = ""
    while gpus > 0:
        # The config allows at most 4096 GPUs per entry.
        count, gpus = min(gpus, 4096), gpus - min(gpus, 4096)
        entries += f"    - {{model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi, count: {count}}}\n"
    return f"version: v1\nbackend: simulated\nsimulated:\n  gpus:\n{entries}"


def _published(api: ApiStandIn) -> int:
    # Straight from the store: list() deep-copies, and polling 10,000 devices that way would load the machine.
    return sum(len(obj["spec"].get("devices", [])) for (plural, _, _), obj in api.objects.items()
               if plural == "resourceslices")


def _split(log: Path) -> str:
    """Where the driver's time went, from its debug log: reading the claims from the API, and its own work."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if "reading them took" in line]
    return lines[-1].split(": ", 1)[-1].split(" claim(s): ", 1)[-1] if lines else "no timing in the driver log"


def tmpfs_dir(workdir: Path) -> Path:
    """A directory on tmpfs where there is one: on a node, /var/run/cdi is tmpfs, and so should the bench's be."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        return Path(tempfile.mkdtemp(prefix="gp-bench-cdi-", dir=shm))
    return workdir / "cdi"


async def bench_dra(workdir: Path, figures: list[Figure]) -> None:
    for devices in SIZES:
        root = workdir / f"dra-{devices}"
        root.mkdir()
        cdi_dir = tmpfs_dir(root)
        api = ApiStandIn()
        await api.start()
        await api.create("nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        (root / "kubeconfig").write_text(api.kubeconfig())
        (root / "config.yaml").write_text(dra_config(devices))
        kubelet = DraKubelet(root / "registry", api, NODE)
        await kubelet.start()
        log = (root / "driver.log").open("wb")
        began = time.monotonic()
        process = subprocess.Popen(
            [sys.executable, "-m", "gpuppetti", "dra", "--config", str(root / "config.yaml"), "--node-name", NODE,
             "--registry-dir", str(root / "registry"), "--plugins-dir", str(root / "plugins"), "--cdi-dir",
             str(cdi_dir), "--kubeconfig", str(root / "kubeconfig"), "--http-address", "",
             "--log-level", "debug"], stdout=log, stderr=subprocess.STDOUT)
        try:
            try:
                await kubelet.wait_registered(DRIVER, timeout=60)
            except TimeoutError:
                raise RuntimeError(f"the DRA driver did not register:\n{(root / 'driver.log').read_text()}") from None

            async with asyncio.timeout(120):
                while _published(api) < devices:
                    await asyncio.sleep(0.01)
            seconds = time.monotonic() - began
            slices = len(api.list("resourceslices"))
            figures.append(Figure(f"DRA ResourceSlices published, {devices} devices", seconds * 1000, "ms", "report",
                                  None, f"{slices} slice(s), from process start"))
            if devices > 1000:
                continue
            claims = []
            for n in range(min(devices, 1000)):
                claim = await api.create("resourceclaims", {
                    "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": f"c{n}", "namespace": "default"},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": DRIVER}}]}},
                }, "default")
                claim["status"] = {"allocation": {"devices": {"results": [
                    {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": f"gpu-apple-{n}"}]}}}
                claim = await api.update("resourceclaims", claim, "default", status=True)
                claims.append(ClaimKey("default", f"c{n}", claim["metadata"]["uid"]))
            began = time.perf_counter()
            answers = await kubelet.call(DRIVER, "prepare", claims)
            elapsed = (time.perf_counter() - began) * 1000
            errors = [a.error for a in answers.values() if a.error]
            goal = "≤ 200 ms" if len(claims) == 100 else "report"
            figures.append(Figure(f"DRA NodePrepareResources, {len(claims)} claims in one call", elapsed, "ms", goal,
                                  elapsed <= 200 if len(claims) == 100 else None,
                                  f"{len(list(cdi_dir.glob('*.json')))} CDI specs written to {cdi_dir.parent}; "
                                  + _split(root / "driver.log")
                                  + (f"; {len(errors)} errors: {errors[0]}" if errors else "")))
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
            log.close()
            await kubelet.stop()
            await api.stop()
            shutil.rmtree(cdi_dir, ignore_errors=True)


def render(figures: list[Figure], console: Console) -> None:
    table = Table(title="gpuppetti benchmarks", title_justify="left")
    for column in ("figure", "value", "goal", "met", "detail"):
        table.add_column(column)
    for figure in figures:
        value = "-" if figure.value is None else f"{figure.value:.3g} {figure.unit}"
        met = {True: "[green]yes[/green]", False: "[red]no[/red]", None: ""}[figure.met]
        table.add_row(figure.name, value, figure.goal, met, figure.detail)
    console.print(table)


async def main_async(args: argparse.Namespace) -> list[Figure]:
    figures: list[Figure] = []
    workdir = Path(tempfile.mkdtemp(prefix="gp-bench-", dir="/tmp"))
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("plugin basics", lambda: bench_plugin_basics(workdir, args.idle_seconds, figures)),
        *[(f"{units} units", lambda units=units: bench_size(workdir, units, args.calls, figures)) for units in SIZES],
        ("DRA", lambda: bench_dra(workdir, figures)),
    ]
    try:
        await bench_list_building(figures)
        for label, step in steps:
            print(f"bench: {label}...", file=sys.stderr, flush=True)
            await step()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the figures as JSON")
    parser.add_argument("--idle-seconds", type=float, default=30.0, help="how long to measure idle CPU (default 30)")
    parser.add_argument("--calls", type=int, default=2000, help="Allocate calls per size (default 2000)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)
    figures = asyncio.run(main_async(args))
    render(figures, Console(width=200) if not sys.stdout.isatty() else Console())
    if args.json:
        args.json.write_text(json.dumps([asdict(f) for f in figures], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
