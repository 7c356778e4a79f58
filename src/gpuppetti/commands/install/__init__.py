"""``gpuppetti install`` and ``gpuppetti uninstall``: from the current kube context to enforced slices, and back.

The objects are those of ``gpuppetti manifests`` (``commands.manifests`` renders them), applied through the API
server with lightkube's server-side apply, not through ``helm``: a Mac user's one command must not need a second
tool, lightkube already talks to the cluster for the DRA driver, and server-side apply makes a second install an
update rather than an error. The Helm chart stays for those who manage releases with Helm (docs/helm.md).

What kind of cluster it is (minikube, and with which driver; kind; k3s; any other node) is read from the nodes'
own facts (minikube's node labels, kind's provider ID, k3s's kubelet version), and decides how the image reaches
the nodes: built in minikube's VM, loaded into kind's nodes, imported into a local k3s's containerd, or pulled from
a registry by any other node. Every step prints what it does; what cannot be done ends the command with one line,
as an InstallError saying whether the user can fix it (exit 2) or the cluster failed (exit 1).

The steps, each in its module: ``cluster`` (the kubeconfig, what kind of cluster it is, and the calls made to its
API server), ``image`` (how the image reaches the nodes), ``applying`` (the objects and the node labels),
``waiting`` (until the GPUs are served), ``smoke`` (the smoke pod), over ``settings`` (what the command line asks)
and ``errors``; ``installing`` and ``uninstalling`` are the two commands, step by step.
"""

from __future__ import annotations

from gpuppetti.commands.install.errors import InstallError
from gpuppetti.commands.install.installing import Outcome, install
from gpuppetti.commands.install.settings import Settings
from gpuppetti.commands.install.uninstalling import uninstall

__all__ = ["InstallError", "Outcome", "Settings", "install", "uninstall"]
