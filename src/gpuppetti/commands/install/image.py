"""How the image reaches the cluster's nodes: built in minikube's VM, loaded into kind's nodes, imported into a
local k3s's containerd, or pulled from a registry; and the tools that do it, run."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from gpuppetti.base.processes import run_within
from gpuppetti.commands import manifests
from gpuppetti.commands.install.cluster import Cluster
from gpuppetti.commands.install.errors import InstallError

# Tools that build or load an image may take minutes (a first build downloads its base image).
TOOL_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class ImagePlan:
    image: str
    # Each command, in order; empty where the nodes pull the image themselves.
    steps: tuple[tuple[str, ...], ...]
    # Why these steps, for the user.
    how: str
    # Whether the image was put on the nodes: the kubelet must not try to pull it then.
    loaded: bool


def container_engine() -> str | None:
    return next((tool for tool in ("docker", "podman") if shutil.which(tool)), None)


def image_plan(cluster: Cluster, image: str | None, build: Path | None, engine: str | None, scratch: Path,
               root: bool) -> ImagePlan:
    """The commands that put the image on ``cluster``'s nodes: built from ``build`` (a checkout with the
    Dockerfile), or ``image`` as the user named it, which the nodes pull. Raises InstallError."""
    if build is None:
        if image is None:
            raise InstallError("no image to run: give --image REF (one the nodes can pull), or --build DIR (a "
                               "gpuppetti checkout) to build one onto the cluster", bad_input=True)
        return ImagePlan(image, (), "nothing to load: the nodes pull it, or have it already", loaded=False)
    if not (build / "Dockerfile").is_file():
        raise InstallError(f"--build {build}: no Dockerfile there (give a gpuppetti checkout)", bad_input=True)
    target = image or manifests.DEFAULT_IMAGE
    context = str(build)
    if cluster.kind == "minikube":
        return ImagePlan(target, (("minikube", "-p", cluster.name, "image", "build", "-t", target, context),),
                         f"built inside minikube's VM (profile {cluster.name})", loaded=True)
    if engine is None:
        raise InstallError(f"building {target} needs docker or podman, and neither is on PATH: install one, or "
                           "give --image REF that the nodes can pull", bad_input=True)
    built = (engine, "build", "-t", target, context)
    archive = str(scratch / "gpuppetti-image.tar")
    if cluster.kind == "kind":
        steps: tuple[tuple[str, ...], ...]
        if engine == "docker":
            steps = (built, ("kind", "load", "docker-image", target, "--name", cluster.name))
        else:
            steps = (built, (engine, "save", "-o", archive, target),
                     ("kind", "load", "image-archive", archive, "--name", cluster.name))
        return ImagePlan(target, steps, f"built with {engine} and loaded into kind cluster {cluster.name}'s nodes",
                         loaded=True)
    if cluster.kind == "k3s":
        if not cluster.local:
            raise InstallError("k3s's containerd is on its node, not here: run gpuppetti install on the node, or give "
                               "--image REF from a registry the node pulls from", bad_input=True)
        sudo = () if root else ("sudo",)
        return ImagePlan(target, (built, (engine, "save", "-o", archive, target),
                                  (*sudo, "k3s", "ctr", "images", "import", archive)),
                         f"built with {engine} and imported into k3s's containerd", loaded=True)
    raise InstallError("this cluster is not minikube, kind or k3s: its nodes pull their image from a registry; push "
                       f"one (`{engine} build -t REGISTRY/gpuppetti:TAG . && {engine} push ...`) and give --image "
                       "REF instead of --build", bad_input=True)


async def run_steps(steps: Iterable[Sequence[str]], say: Callable[[str], None],
                    timeout: float = TOOL_TIMEOUT_S) -> None:
    """Run each command with its output on the terminal. Raises InstallError: a missing tool is the user's to
    install (exit 2), a failing one a failure (exit 1)."""
    for argv in steps:
        tool = argv[1] if argv[0] == "sudo" else argv[0]
        if shutil.which(argv[0]) is None or shutil.which(tool) is None:
            raise InstallError(f"{tool} is not on PATH: install it, or give --image REF that the nodes can pull",
                               bad_input=True)
        say(f"  $ {' '.join(argv)}")
        try:
            code, _, _ = await run_within(list(argv), timeout, stdout=None, stderr=None)
        except TimeoutError:
            raise InstallError(f"`{' '.join(argv)}` did not finish within {timeout:g}s") from None
        except OSError as exc:
            raise InstallError(f"cannot run {tool}: {exc.strerror or exc}") from None
        if code != 0:
            raise InstallError(f"`{' '.join(argv)}` failed (exit {code}); its output is above")
