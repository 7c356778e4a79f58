"""The command line as a user meets it: exit codes and messages."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import Daemon, DaemonProcess, run_cli, short_tmpdir

pytestmark = pytest.mark.e2e


def test_broken_config_exits_2_with_one_message_naming_file_and_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.yaml"
    config.write_text(
        "version: v1\nsharing:\n  timeSlicing:\n    resources:\n      - {name: apple.com/gpu, replicas: -2}\n"
    )
    result = run_cli("plugin", "--config", str(config), "--device-plugin-dir", str(tmp_path / "dp"))
    assert result.returncode == 2
    assert f"{config}: sharing.timeSlicing.resources[0].replicas: " in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "dp").exists(), "a broken config must not start anything"


def test_config_from_the_environment(tmp_path: Path) -> None:
    config = tmp_path / "env.yaml"
    config.write_text("version: v1\nunknown: 1\n")
    result = run_cli("plugin", "--device-plugin-dir", str(tmp_path), env={"GPUPPETTI_CONFIG": str(config)})
    assert result.returncode == 2
    assert f"{config}: unknown: unknown key" in result.stderr


async def test_no_gpus_keeps_the_plugin_up_saying_why(tmp_path: Path) -> None:
    plugin = DaemonProcess(["plugin", "--backend", "simulated", "--device-plugin-dir", str(tmp_path / "dp")], None,
                           tmp_path, "no-gpus")
    try:
        url = await plugin.http_url()
        await plugin.wait_for_log("serving nothing until a GPU appears")
        status, body = await asyncio.to_thread(_get, url + "/healthz")
        assert (status, body.startswith("ok: no GPUs found on this node")) == (200, True), body
        assert plugin.running()
        assert await plugin.stop() == 0
    finally:
        plugin.kill()


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return answer.status, answer.read().decode()


def test_unusable_socket_directory_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("version: v1\nsimulated:\n  gpus:\n    - {model: X}\n")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_cli("plugin", "--config", str(config), "--device-plugin-dir", str(blocker / "dp"),
                     "--http-address", "")
    assert result.returncode == 1
    assert (f"the device plugin directory {blocker / 'dp'} cannot exist: {blocker} is not a directory "
            "(see --device-plugin-dir)") in result.stderr
    assert "Traceback" not in result.stderr


def test_help_documents_the_flags() -> None:
    result = run_cli("plugin", "--help")
    assert result.returncode == 0
    for flag in ("--config", "--device-plugin-dir", "--backend", "--log-level", "GPUPPETTI_CONFIG",
                 "GPUPPETTI_DEVICE_PLUGIN_DIR", "/var/lib/kubelet/device-plugins"):
        assert flag in result.stdout


def test_demo_prints_the_tables_and_exits_0() -> None:
    result = run_cli("demo")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("GPUs", "Apple M3 Max", "48 GiB", "Slices", "Pods", "sim-apple-0::0", "sim-apple-1::3",
                 "GPUPPETTI_SLICES=", "GPUPPETTI_SHARING=time-slicing", "not admitted", "re-registered"):
        assert text in out, text


def test_demo_with_a_broken_config(tmp_path: Path) -> None:
    config = tmp_path / "demo.yaml"
    config.write_text("version: v1\nsimulated:\n  gpus:\n    - {model: X, count: many}\n")
    result = run_cli("demo", "--config", str(config))
    assert result.returncode == 2
    assert f"{config}: simulated.gpus[0].count" in result.stderr


def test_dra_help_documents_every_flag() -> None:
    result = run_cli("dra", "--help")
    assert result.returncode == 0
    for flag in ("--node-name", "NODE_NAME", "--registry-dir", "/var/lib/kubelet/plugins_registry", "--plugins-dir",
                 "/var/lib/kubelet/plugins", "--cdi-dir", "/var/run/cdi", "--kubeconfig", "--config", "--backend",
                 "--host-root", "--http-address", "--log-level"):
        assert flag in result.stdout, flag


def test_every_command_is_listed() -> None:
    result = run_cli("--help")
    for command in ("plugin", "dra", "discover", "manifests", "host-agent", "demo"):
        assert command in result.stdout


NO_CORES = """\
version: v1
simulated:
  gpus:
    - {model: Mystery GPU, vendor: apple}
sharing:
  timeSlicing:
    resources:
      - {name: apple.com/gpu, replicasPerCores: 10}
      - {name: nvidia.com/gpu, replicas: 4}
"""


def test_a_sharing_entry_that_does_nothing_is_said(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(NO_CORES)
    result = run_cli("discover", "--config", str(config))
    assert result.returncode == 0, result.stderr
    assert (f"gpuppetti: warning: {config}: sharing.timeSlicing.resources[0].replicasPerCores: GPU sim-apple-0 has "
            "no known core count, so it gets 1 replica") in result.stderr
    # An entry for a vendor this node lacks is what a config shared by many nodes has: a note, not a warning.
    assert (f"gpuppetti: note: {config}: sharing.timeSlicing.resources[1].name: no GPU here is offered as "
            "nvidia.com/gpu") in result.stderr


async def test_the_plugin_logs_the_warning(tmp_path: Path, start_plugin: Callable[..., Daemon]) -> None:
    plugin = start_plugin(NO_CORES)
    await plugin.wait_for_log("replicasPerCores: GPU sim-apple-0 has no known core count")
    assert "WARNING" in next(line for line in plugin.log().splitlines() if "no known core count" in line)


async def test_a_device_plugin_directory_that_is_not_there_is_waited_for_not_made(tmp_path: Path) -> None:
    # Short: under pytest's base directory (and xdist's worker directory) the socket path could pass the 107 bytes
    # Unix sockets allow.
    directory = short_tmpdir() / "elsewhere" / "dp"
    plugin = DaemonProcess(["plugin", "--device-plugin-dir", str(directory)],
                           "version: v1\nsimulated:\n  gpus:\n    - {model: X, vendor: apple}\n", tmp_path, "made")
    try:
        says = f"waiting for the kubelet's device plugin directory {directory} to exist"
        await plugin.wait_for_log(says)
        status, body = await asyncio.to_thread(_get_any, await plugin.http_url() + "/healthz")
        assert status == 503 and says in body and "is --device-plugin-dir the directory of this node's kubelet" in body
        assert not directory.parent.exists(), "nothing is made in the kubelet's place"
        # Once the kubelet has made it, the plugin goes on: it waits for the kubelet's socket there.
        directory.mkdir(parents=True)
        await plugin.wait_for_log("waiting for the kubelet:", timeout=15)
        assert plugin.running()
    finally:
        plugin.kill()


def _get_any(url: str) -> tuple[int, str]:
    try:
        return _get(url)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.parametrize(("args", "label"), [([], "plugin"), (["--mode", "dra"], "dra"),
                                             (["--preset", "minikube-krunkit"], None)])
def test_manifests_says_which_nodes_its_daemonset_runs_on(args: list[str], label: str | None) -> None:
    result = run_cli("manifests", *args)
    assert result.returncode == 0, result.stderr
    if label is None:
        assert result.stderr == "", "a preset runs on every node: nothing to label"
    else:
        assert result.stderr.strip() == (f"gpuppetti: the DaemonSet runs only on nodes labelled gpuppetti.dev/mode="
                                         f"{label}: kubectl label node NODE gpuppetti.dev/mode={label}")
