"""``gpuppetti install``, step by step: the cluster, the image, the objects applied, the GPUs waited for, the smoke
pod, and what to do next."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpuppetti.commands import manifests
from gpuppetti.commands.install.applying import apply, choose_config, chosen_nodes, label, render
from gpuppetti.commands.install.cluster import Cluster, connected
from gpuppetti.commands.install.image import container_engine, image_plan, run_steps
from gpuppetti.commands.install.settings import Settings
from gpuppetti.commands.install.smoke import KRUNKIT_SMOKE_IMAGE, SMOKE_IMAGE, SMOKE_POD, run_smoke
from gpuppetti.commands.install.waiting import served_names, wait_served


@dataclass
class Outcome:
    """What install did: the resources served, how long from the first object applied to the first slice, and
    what the smoke pod printed."""

    served: dict[str, str] = field(default_factory=dict)
    # From the first object applied: what the image's build or load, which varies most, does not count in.
    seconds_to_first_slice: float = 0.0
    smoke_log: str = ""


async def install(settings: Settings, say: Callable[[str], None]) -> Outcome:
    """Install gpuppetti on the kube context's cluster, wait for its GPUs, and run the smoke pod. Raises
    InstallError."""
    outcome = Outcome()
    begun = time.monotonic()
    say("1. finding the cluster")
    async with connected(settings, say) as (api, cluster, server):
        say(f"  {cluster.describe()}")
        nodes = chosen_nodes(cluster, settings.nodes)
        config, config_source = choose_config(cluster, settings)
        say("2. getting the image onto the nodes")
        with tempfile.TemporaryDirectory(prefix="gpuppetti-install-") as scratch:
            plan = image_plan(cluster, settings.image, settings.build, container_engine(), Path(scratch),
                              os.geteuid() == 0)
            say(f"  {plan.image}: {plan.how}")
            await run_steps(plan.steps, say)
        objects = render(settings, config, plan.image, plan.loaded, server)
        say(f"3. applying the objects of `gpuppetti manifests --mode {settings.mode}` by server-side apply (config: "
            f"{config_source})")
        started = time.monotonic()
        await apply(api, objects, say)
        say(f"4. labelling {', '.join(nodes)} {manifests.MODE_LABEL}={settings.mode} (where the DaemonSet runs)")
        await label(api, nodes, settings.mode)
        what = ("the GPUs are allocatable" if settings.mode == "plugin" else
                "the devices are published in ResourceSlices")
        say(f"5. waiting until {what} (up to {settings.timeout:g}s)")
        outcome.served = await wait_served(api, settings, nodes, served_names(config))
        outcome.seconds_to_first_slice = time.monotonic() - started
        for node, served in outcome.served.items():
            say(f"  node {node}: {served}")
        say(f"  first slice {'allocatable' if settings.mode == 'plugin' else 'published'} "
            f"{outcome.seconds_to_first_slice:.1f}s after the first object was applied "
            f"({time.monotonic() - begun:.1f}s since the command started)")
        say("6. running the smoke pod, which asks for one slice and prints it as the Vulkan layer shows it")
        resource = next(iter(outcome.served.values())).split("=", 1)[0] if settings.mode == "plugin" else None
        smoke_image = settings.smoke_image or (KRUNKIT_SMOKE_IMAGE if cluster.driver == "krunkit" else SMOKE_IMAGE)
        outcome.smoke_log = await run_smoke(api, settings, resource, smoke_image)
        for line in outcome.smoke_log.rstrip().splitlines():
            say(f"  | {line}")
        say(next_steps(settings, cluster, resource))
    return outcome


def next_steps(settings: Settings, cluster: Cluster, resource: str | None) -> str:
    ns = settings.namespace
    daemonset = f"ds/gpuppetti-{manifests.COMPONENTS[settings.mode]}"
    asking = (f"resources.limits {{{resource}: 1}}" if settings.mode == "plugin" else
              f"a ResourceClaim of DeviceClass {manifests.DRIVER} (see deploy/examples/dra/)")
    lines = [
        "done. Next:",
        f"  kubectl -n {ns} logs {SMOKE_POD}    # what the smoke pod printed",
        f"  give a pod a slice with {asking}; in it, gpuppetti-vkinfo shows the slice",
        f"  kubectl -n {ns} exec {daemonset} -- gpuppetti top    # who holds which slice",
        "  gpuppetti uninstall    # removes all of it again",
    ]
    if cluster.driver == "krunkit":
        lines.insert(4, "  gpuppetti host-agent on the Mac gives the VM its GPU's model, cores and memory "
                        "(docs/apple-silicon.md)")
    return "\n".join(lines)
