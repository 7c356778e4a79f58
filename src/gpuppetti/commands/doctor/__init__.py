"""``gpuppetti doctor``: what gpuppetti needs on a node, checked, with the fix for what is missing."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gpuppetti.commands.doctor import checks, cluster, enforcement, vulkan, window
from gpuppetti.commands.doctor.checks import Settings
from gpuppetti.commands.doctor.result import MARKS, Result, Status

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["Result", "Settings", "Status", "checkup", "print_checkup"]


async def checkup(settings: Settings) -> list[Result]:
    results, found = await asyncio.to_thread(checks.config_and_gpus, settings.sources)
    host = settings.sources.host_root
    gpus = found.gpus if found is not None else []
    async with asyncio.TaskGroup() as group:
        drivers = group.create_task(vulkan.driver_checks(gpus, host), name="doctor-vulkan-drivers")
        agent = group.create_task(checks.host_agent_check(settings.sources, found), name="doctor-host-agent")
        plugins = group.create_task(checks.device_plugin_dir(settings.device_plugin_dir, settings.mode),
                                    name="doctor-dp-dir")
        registry = group.create_task(checks.registry_dir(settings.registry_dir, settings.mode),
                                     name="doctor-registry")
        runtime = group.create_task(checks.runtime_checks(settings.runtime_endpoint, host, settings.cdi_dir,
                                                           settings.containerd_address),
                                    name="doctor-runtime")
        daemon = group.create_task(checks.daemon_check(settings.daemon_url), name="doctor-daemon")
        features = group.create_task(cluster.cluster_checks(settings.kubeconfig, settings.mode),
                                     name="doctor-cluster")
        held = group.create_task(asyncio.to_thread(
            enforcement.enforcement_checks, gpus, host, checks.layer_holds(settings.vulkan_layer_dir, found)),
            name="doctor-enforced-by")
    return [
        *results,
        agent.result(),
        plugins.result(),
        registry.result(),
        *runtime.result(),
        checks.cdi_dir_check(settings.cdi_dir),
        checks.vulkan_check(host),
        *(drivers.result() if gpus else []),
        *window.window_checks(gpus, checks.slice_sizes(found), host),
        checks.layer_check(settings.vulkan_layer_dir),
        *held.result(),
        daemon.result(),
        *features.result(),
    ]


STYLES = {Status.OK: "green", Status.WARN: "yellow", Status.FAIL: "red", Status.SKIP: "dim"}


def print_checkup(console: Console, results: list[Result]) -> None:
    """One row per check, the fix under each one that failed or warned, and a closing count."""
    from rich.table import Table
    from rich.text import Text

    from gpuppetti.base.tables import print_trimmed

    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True, style="bold")
    grid.add_column(overflow="fold")
    for result in results:
        style = STYLES[result.status]
        grid.add_row(Text(MARKS[result.status], style=style), Text(result.check), Text(result.detail))
        if result.fix and result.status in (Status.FAIL, Status.WARN):
            grid.add_row("", "", Text.assemble(("fix: ", style), result.fix))
    print_trimmed(console, grid)
    failed = sum(result.failed for result in results)
    warned = sum(result.status is Status.WARN for result in results)
    summary = f"{failed} check(s) failed" if failed else "nothing failed"
    console.print(Text(f"{summary}, {warned} warning(s)", style="red" if failed else "green"))
