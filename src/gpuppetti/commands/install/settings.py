"""What ``gpuppetti install`` and ``gpuppetti uninstall`` are asked to do, as the command line gives it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpuppetti.commands import manifests

DEFAULT_TIMEOUT_S = 300.0


def default_minikube_home() -> Path:
    # MINIKUBE_HOME may name the .minikube folder itself or the folder that holds it, as minikube takes it.
    home = Path(os.environ.get("MINIKUBE_HOME", "~")).expanduser()
    return home if home.name == ".minikube" else home / ".minikube"


@dataclass(frozen=True)
class Settings:
    kubeconfig: Path | None
    context: str | None
    mode: manifests.Mode = "plugin"
    namespace: str = manifests.DEFAULT_NAMESPACE
    image: str | None = None
    build: Path | None = None
    # The config file's text, or None for the cluster's preset (minikube with krunkit) or the default.
    config: str | None = None
    config_source: str | None = None
    replicas: int | None = None
    nodes: tuple[str, ...] = ()
    host_network: bool = False
    smoke_image: str | None = None
    timeout: float = DEFAULT_TIMEOUT_S
    minikube_home: Path = field(default_factory=default_minikube_home)
