"""Converters for flag and env var values: each returns the value or raises ArgumentTypeError saying what is
wrong, in words that follow the flag's or the env var's name."""

from __future__ import annotations

import argparse
import math
import os
import posixpath
import re
import sys
from collections.abc import Callable
from pathlib import Path

from gpuppetti.base.nodepaths import (
    DAEMONSET_MOUNTS,
    DEFAULT_VULKAN_LAYER_DIR,
    LAYER_DIR_MAX_BYTES,
    SYSTEM_DIRECTORIES,
    SYSTEM_TREES,
)
from gpuppetti.base.quantity import parse_quantity
from gpuppetti.base.syntax import (
    dns_label_problem,
    dns_subdomain_problem,
    host_path_problem,
    http_url_problem,
    image_problem,
    label_key_problem,
    label_value_problem,
)
from gpuppetti.base.webserver import AddressError, format_address, parse_address

Bad = argparse.ArgumentTypeError
# A flag's default where its converter may return None as a value of its own (--limits none).
UNGIVEN = object()


def choice(*allowed: str) -> Callable[[str], str]:
    def convert(text: str) -> str:
        if text not in allowed:
            raise Bad(f"must be one of {', '.join(allowed)}")
        return text

    convert.__name__ = "choice"
    return convert


# The Helm chart's first spelling of the device plugin's mode, which still means it.
OLD_PLUGIN_MODE = "deviceplugin"


def mode(*allowed: str) -> Callable[[str], str]:
    """A mode, spelled as the node label gpuppetti.dev/mode spells it (plugin, dra); the old spelling deviceplugin
    still means plugin, and says so on a line of its own."""
    plain = choice(*allowed)

    def convert(text: str) -> str:
        if text == OLD_PLUGIN_MODE and "plugin" in allowed:
            print(f"gpuppetti: warning: mode {OLD_PLUGIN_MODE!r} is the old spelling of 'plugin', which it means; "
                  "write plugin", file=sys.stderr)
            return "plugin"
        return plain(text)

    convert.__name__ = "mode"
    return convert


def seconds(text: str) -> float:
    """A positive number of seconds, at most a day: 0 or less would make a loop spin."""
    try:
        value = float(text)
    except ValueError:
        raise Bad("expected a number of seconds, such as 5 or 0.5") from None
    if not math.isfinite(value) or value <= 0:
        raise Bad("must be more than 0 seconds")
    if value > 86400:
        raise Bad("must be at most 86400 seconds (a day)")
    return value


def count(low: int, high: int) -> Callable[[str], int]:
    def convert(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise Bad(f"expected a whole number from {low} to {high}") from None
        if not low <= value <= high:
            raise Bad(f"must be from {low} to {high}")
        return value

    return convert


def http_address(text: str) -> str:
    """HOST:PORT for the metrics and health endpoint; empty turns it off."""
    if text:
        _address(text)
    return text


def listen_address(text: str) -> str:
    _address(text)
    return text


def _address(text: str) -> None:
    try:
        parse_address(text, "address")
    except AddressError as exc:
        raise Bad(str(exc).removeprefix("address: ")) from None


def daemon_address(text: str) -> str:
    """Where a daemon serves HTTP, as a URL, or as its --http-address (HOST:PORT; no host means this machine).
    Returns the URL. Every command that asks a daemon (discover --from, top --from, doctor --daemon) takes this."""
    if "://" in text:
        return http_url(text)
    try:
        host, port = parse_address(text, "address")
    except AddressError:
        raise Bad("expected a URL such as http://127.0.0.1:9400, or HOST:PORT such as 127.0.0.1:9400 or :9400") \
            from None
    if host in (None, "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://{format_address(host, port)}"


def http_url(text: str) -> str:
    if (problem := http_url_problem(text)) is not None:
        raise Bad(problem)
    return text


def directory(text: str) -> Path:
    """A directory that must exist already (the host's root)."""
    path = _path(text)
    if not path.is_dir():
        raise Bad("no such directory" if not path.exists() else "is not a directory")
    return path


def path(text: str) -> Path:
    """A path the command may create (a socket directory): it must not be empty."""
    return _path(text)


def cdi_directory(text: str) -> Path:
    """Where CDI specs go: an absolute directory, as the container runtimes read them (a relative one would be made
    in whatever directory the command ran in, where no runtime looks)."""
    if text and not text.startswith("/"):
        raise Bad("must be an absolute path, such as /var/run/cdi or /etc/cdi, where the container runtime reads "
                  "CDI specs")
    return _path(text)


def _path(text: str) -> Path:
    if not text:
        raise Bad("must not be empty")
    return Path(text)


def endpoint(text: str) -> Path:
    """A CRI endpoint as crictl takes it: a socket path, or unix:// and the path."""
    if text.startswith("unix://"):
        text = text.removeprefix("unix://")
    elif "://" in text:
        raise Bad("expected a Unix socket: a path, or unix:///path")
    return _path(text)


def kubeconfig(text: str, current: bool = True) -> Path:
    """One kubeconfig, or a list separated by ':' as kubectl takes them; at least one must exist."""
    paths = [Path(os.path.expanduser(part)) for part in text.split(os.pathsep) if part]
    if not paths:
        raise Bad("must not be empty")
    if not any(candidate.is_file() for candidate in paths):
        if len(paths) == 1 and paths[0].is_dir():
            raise Bad("is a directory: give the kubeconfig file in it (such as ~/.kube/config)")
        if len(paths) == 1 and paths[0].exists():
            raise Bad("is not a regular file")
        raise Bad("no such file" if len(paths) == 1 else "none of these files exists")
    # Read whole now: a truncated file or one with no current context is the user's to fix, said before anything
    # starts (exit 2), not a traceback from the first client made.
    from gpuppetti.node.kube import ConfigError, read_kubeconfig

    try:
        read_kubeconfig(Path(text), current)
    except ConfigError as exc:
        raise Bad(exc.problem if len(paths) == 1 else str(exc)) from None
    return Path(text)


def kubeconfig_any_context(text: str) -> Path:
    """A kubeconfig as ``kubeconfig`` checks it, for a command with --context: its current context is not needed."""
    return kubeconfig(text, current=False)

_INSTANCE = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")


def instance_name(text: str) -> str:
    """A daemon instance's name, which its sockets carry: a pod's UID, or any DNS label (so that a socket's name
    never holds a slash or a dot)."""
    if not _INSTANCE.fullmatch(text):
        raise Bad("is not an instance name: at most 63 lowercase letters, digits and '-', starting and ending with "
                  "a letter or digit (in a DaemonSet, the pod's UID: fieldRef metadata.uid)")
    return text


def node_name(text: str) -> str:
    if (problem := dns_subdomain_problem(text)) is not None:
        raise Bad(f"is not a node name: {problem}")
    return text


def namespace(text: str) -> str:
    if (problem := dns_label_problem(text)) is not None:
        raise Bad(f"is not a namespace name: {problem}")
    return text


def image(text: str) -> str:
    if (problem := image_problem(text)) is not None:
        raise Bad(problem)
    return text


def label(text: str) -> tuple[str, str]:
    """KEY=VALUE, a node label to select by."""
    key, equals, value = text.partition("=")
    if not equals:
        raise Bad("expected KEY=VALUE, such as kubernetes.io/arch=arm64")
    if (problem := label_key_problem(key) or label_value_problem(value)) is not None:
        raise Bad(problem)
    return key, value


TAINT_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")


def toleration(text: str) -> dict[str, str]:
    """A toleration in kubectl taint's words: KEY[=VALUE][:EFFECT]; without a value it tolerates any value, without
    an effect every effect."""
    taint, colon, effect = text.partition(":")
    key, equals, value = taint.partition("=")
    if colon and effect not in TAINT_EFFECTS:
        raise Bad(f"the effect after ':' must be one of {', '.join(TAINT_EFFECTS)}")
    if (problem := label_key_problem(key) or label_value_problem(value)) is not None:
        raise Bad(problem)
    found = {"key": key, "operator": "Equal", "value": value} if equals else {"key": key, "operator": "Exists"}
    if colon:
        found["effect"] = effect
    return found


def resource_list(text: str) -> dict[str, str] | None:
    """NAME=QUANTITY[,NAME=QUANTITY...], as kubectl set resources takes them; ``none`` for none at all."""
    if text == "none":
        return None
    found: dict[str, str] = {}
    for item in text.split(","):
        name, equals, quantity = item.partition("=")
        # parse_quantity forgives the spaces around a config's value; a manifest would carry them to the API server.
        if not equals or name not in ("cpu", "memory") or quantity != quantity.strip():
            raise Bad("expected cpu=QUANTITY and/or memory=QUANTITY, comma-separated (cpu=50m,memory=128Mi), or none")
        try:
            if parse_quantity(quantity) <= 0:
                raise ValueError
        except ValueError:
            raise Bad(f"{name}={quantity}: expected a positive quantity such as 50m or 128Mi") from None
        found[name] = quantity
    return found


def host_directory(text: str) -> Path | None:
    """An absolute directory on the node, as a hostPath takes it (the Vulkan layer's, which containers mount);
    '' for none. The same for the daemons that install there and for the manifests that mount it: a directory of
    its own, neither a system directory nor one the DaemonSets mount for something else."""
    if not text:
        return None
    if (problem := host_path_problem(text)) is not None:
        raise Bad(f"{problem}, or '' for none")
    if (problem := layer_directory_problem(text)) is not None:
        raise Bad(f"{problem}: give a directory of its own, such as {DEFAULT_VULKAN_LAYER_DIR}, or '' for none")
    return Path(text)


def layer_directory_problem(text: str) -> str | None:
    """Why the absolute path ``text`` cannot be the Vulkan layer's directory; None when it can."""
    path = posixpath.normpath("/" + text.lstrip("/"))
    for mount, what in DAEMONSET_MOUNTS.items():
        if path == mount:
            return f"{path} is where the DaemonSets mount {what}"
        if path.startswith(mount + "/"):
            return f"{path} is inside {mount}, where the DaemonSets mount {what}"
        if mount.startswith(path.rstrip("/") + "/"):
            return f"{path} holds {mount}, where the DaemonSets mount {what}"
    if len(path.encode()) > LAYER_DIR_MAX_BYTES:
        return (f"{path} is too long: the ledgers' sockets are made under it, and a socket's path is short (at "
                f"most {LAYER_DIR_MAX_BYTES} bytes here)")
    if path in SYSTEM_DIRECTORIES:
        return f"{path} is a system directory"
    for tree in SYSTEM_TREES:
        if path == tree or path.startswith(tree + "/"):
            return f"{path} is in {tree}, the system's own"
    return None
