"""Where each option's value comes from: the flag, else its env var, else its default; all checked alike."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuppetti.cli.main import parse
from gpuppetti.cli.options import UsageError
from gpuppetti.cli.parser import build_parser


def test_a_flag_beats_its_env_var_which_beats_the_default() -> None:
    assert parse(["plugin"], {}).log_level == "info"
    assert parse(["plugin"], {"GPUPPETTI_LOG_LEVEL": "debug"}).log_level == "debug"
    assert parse(["plugin", "--log-level", "error"], {"GPUPPETTI_LOG_LEVEL": "debug"}).log_level == "error"


def test_an_empty_env_var_is_unset_except_where_empty_means_something() -> None:
    args = parse(["plugin"], {"GPUPPETTI_BACKEND": "", "GPUPPETTI_HOST_ROOT": "", "GPUPPETTI_HTTP_ADDRESS": ""})
    assert (args.backend, args.host_root, args.http_address) == (None, Path("/"), "")


def test_the_dra_driver_takes_its_directories_from_the_environment_too() -> None:
    env = {"GPUPPETTI_CDI_DIR": "/x/cdi", "GPUPPETTI_REGISTRY_DIR": "/x/registry", "GPUPPETTI_PLUGINS_DIR": "/x/p",
           "NODE_NAME": "node-1"}
    args = parse(["dra"], env)
    assert (args.cdi_dir, args.registry_dir, args.plugins_dir, args.node_name) == (
        Path("/x/cdi"), Path("/x/registry"), Path("/x/p"), "node-1")
    assert parse(["plugin"], env).cdi_dir == Path("/x/cdi")


def test_an_env_value_is_checked_as_its_flag_would_be() -> None:
    with pytest.raises(UsageError, match=r"GPUPPETTI_LABEL_NODE='maybe': expected true or false \(or give "
                                         r"--label-node\)"):
        parse(["plugin"], {"GPUPPETTI_LABEL_NODE": "maybe"})
    assert parse(["plugin", "--node-name", "n"], {"GPUPPETTI_LABEL_NODE": "true"}).label_node is True
    assert parse(["plugin"], {"GPUPPETTI_LABEL_NODE": "false"}).label_node is False


def _help(command: str) -> str:
    return build_parser().commands[command].format_help()


@pytest.mark.parametrize(("command", "expected"), [
    ("manifests", ["--image IMAGE", "default localhost/gpuppetti:dev", "default no time-slicing",
                   "default gpuppetti)"]),
    ("host-agent", ["default gpuppetti)", "default 127.0.0.1:9410", "env GPUPPETTI_HOST_AGENT_LISTEN",
                    "default 5)"]),
    ("dra", ["env GPUPPETTI_CDI_DIR", "default /var/run/cdi", "env GPUPPETTI_REGISTRY_DIR",
             "default /var/lib/kubelet/plugins_registry", "env GPUPPETTI_API_TIMEOUT", "default 10"]),
    ("plugin", ["env GPUPPETTI_DEVICE_PLUGIN_DIR", "default /var/lib/kubelet/device-plugins", "exit codes:"]),
    ("doctor", ["env CONTAINER_RUNTIME_ENDPOINT", "--daemon ADDRESS", "env GPUPPETTI_MODE", "--json"]),
])
def test_help_gives_each_default_and_env_var(command: str, expected: list[str]) -> None:
    text = " ".join(_help(command).split())
    for phrase in expected:
        assert phrase in text, phrase


def test_doctor_takes_the_daemons_address_as_they_write_it() -> None:
    assert parse(["doctor"], {"GPUPPETTI_HTTP_ADDRESS": ":9400"}).daemon == "http://127.0.0.1:9400"
    assert parse(["doctor", "--daemon", "[::1]:9400"], {}).daemon == "http://[::1]:9400"
    assert parse(["doctor", "--daemon", "http://10.0.0.7:9400"], {}).daemon == "http://10.0.0.7:9400"
    assert parse(["doctor"], {"GPUPPETTI_HTTP_ADDRESS": ""}).daemon is None, "off is not an address to ask"
    assert parse(["doctor"], {"CONTAINER_RUNTIME_ENDPOINT": "unix:///run/x.sock"}).runtime_endpoint == Path(
        "/run/x.sock")


@pytest.mark.parametrize("command", ["", "plugin", "dra", "discover", "doctor", "manifests", "host-agent", "demo"])
def test_help_fits_80_columns(monkeypatch: pytest.MonkeyPatch, command: str) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    parser = build_parser()
    text = (parser.commands[command] if command else parser).format_help()
    assert max(len(line) for line in text.splitlines()) <= 80, text


# -- a value ending in a newline: Python's `$` matched before it, and every one of these took it ---------------------

@pytest.mark.parametrize(("args", "flag"), [
    (["manifests", "--node-selector", "pool=gpu\n"], "--node-selector"),
    (["manifests", "--node-selector", "pool\n=gpu"], "--node-selector"),
    (["manifests", "--toleration", "dedicated\n:NoSchedule"], "--toleration"),
    (["manifests", "--toleration", "dedicated=gpu\n"], "--toleration"),
    (["manifests", "--image", "registry.example/gpuppetti:0.1.0\n"], "--image"),
    (["manifests", "--namespace", "gpus\n"], "--namespace"),
    (["host-agent", "--namespace", "gpus\n"], "--namespace"),
    (["dra", "--node-name", "node-1\n"], "--node-name"),
    (["manifests", "--requests", "cpu=50m\n"], "--requests"),
    (["manifests", "--limits", "memory= 128Mi"], "--limits"),
])
def test_a_value_with_a_trailing_newline_is_refused(args: list[str], flag: str) -> None:
    with pytest.raises(UsageError, match=f"argument {flag}"):
        parse(args, {})


@pytest.mark.parametrize("directory", ["/var/lib/gpuppetti\n", "/var/lib/\tgpuppetti", "/var/lib/../../etc",
                                       "relative/dir", "./vulkan"])
@pytest.mark.parametrize("command", [["plugin"], ["dra", "--node-name", "n"], ["doctor"], ["manifests"]])
def test_the_vulkan_layer_dir_is_one_absolute_host_path_for_every_command(command: list[str], directory: str) -> None:
    with pytest.raises(UsageError, match="--vulkan-layer-dir"):
        parse([*command, "--vulkan-layer-dir", directory], {})


def test_the_vulkan_layer_dir_from_the_environment_is_checked_the_same_way() -> None:
    with pytest.raises(UsageError, match="GPUPPETTI_VULKAN_LAYER_DIR='relative/dir': must be an absolute path"):
        parse(["plugin"], {"GPUPPETTI_VULKAN_LAYER_DIR": "relative/dir"})
    assert parse(["plugin"], {"GPUPPETTI_VULKAN_LAYER_DIR": ""}).vulkan_layer_dir is None
    assert parse(["manifests", "--vulkan-layer-dir", ""], {}).vulkan_layer_dir is None
    for command in (["plugin"], ["manifests"]):
        assert parse([*command, "--vulkan-layer-dir", "/opt/vk"], {}).vulkan_layer_dir == Path("/opt/vk")


@pytest.mark.parametrize(("args", "dest"), [(["discover", "--from"], "from"), (["top", "--from"], "from"),
                                            (["doctor", "--daemon"], "daemon")])
def test_every_command_that_asks_a_daemon_takes_its_address_alike(args: list[str], dest: str) -> None:
    for given, url in ((":9414", "http://127.0.0.1:9414"), ("10.0.0.7:9400", "http://10.0.0.7:9400"),
                       ("http://[::1]:9400", "http://[::1]:9400")):
        assert getattr(parse([*args, given], {}), dest) == url
    with pytest.raises(UsageError, match="expected a URL"):
        parse([*args, "localhost"], {})


def test_doctor_takes_the_old_mode_deviceplugin_as_plugin(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse(["doctor"], {"GPUPPETTI_MODE": "deviceplugin"}).mode == "plugin"
    assert "old spelling of 'plugin'" in capsys.readouterr().err
    assert parse(["doctor", "--mode", "plugin"], {}).mode == "plugin"
    assert capsys.readouterr().err == ""


# The layer's directory is mounted read-write at its node path: where another mount of the DaemonSets is, or a
# system directory, it would be refused by the API server (a duplicate mountPath) or lay itself over the node's
# root, the kubelet's directories or the image's own files.
OVERLAPPING_LAYER_DIRS = [
    ("/host", "is where the DaemonSets mount the node's root"),
    ("/host/", "/host is where the DaemonSets mount the node's root"),
    ("/host/var/lib/gpuppetti", "is inside /host, where the DaemonSets mount the node's root"),
    ("/", "/ holds /host"),
    ("/var/lib/kubelet", "holds /var/lib/kubelet/device-plugins"),
    ("/var/lib/kubelet/plugins/vulkan", "is inside /var/lib/kubelet/plugins"),
    ("/var/run/cdi", "is where the DaemonSets mount the CDI specs"),
    ("/etc/gpuppetti", "is where the DaemonSets mount the config"),
    ("/var/run/secrets", "holds /var/run/secrets/gpuppetti-host-agent"),
    ("/usr/local/lib", "is in /usr, the system's own"),
    ("/proc/self", "is in /proc, the system's own"),
    ("/tmp", "is a system directory"),
    ("/opt", "is a system directory"),
    # The ledgers' sockets are made under it: a socket's path is at most 107 bytes.
    ("/var/lib/" + "gpuppetti-" * 9, "is too long: the ledgers' sockets are made under it"),
]


@pytest.mark.parametrize(("directory", "says"), OVERLAPPING_LAYER_DIRS)
@pytest.mark.parametrize("command", [["plugin"], ["dra", "--node-name", "n"], ["manifests"], ["doctor"]])
def test_a_layer_dir_over_another_mount_or_a_system_directory_is_refused(
        command: list[str], directory: str, says: str) -> None:
    with pytest.raises(UsageError, match="--vulkan-layer-dir") as refused:
        parse([*command, "--vulkan-layer-dir", directory], {})
    assert says in str(refused.value) and "give a directory of its own" in str(refused.value)
    assert "\n" not in str(refused.value)


def test_the_layer_dir_check_knows_every_mount_of_the_daemonsets() -> None:
    from gpuppetti.base.nodepaths import DAEMONSET_MOUNTS
    from gpuppetti.commands import manifests

    for mode in ("plugin", "dra"):
        for obj in manifests.render(manifests.Options(mode=mode)):
            if obj["kind"] != "DaemonSet":
                continue
            for container in obj["spec"]["template"]["spec"]["containers"]:
                paths = {mount["mountPath"] for mount in container["volumeMounts"]} - {"/var/lib/gpuppetti/vulkan"}
                assert paths <= set(DAEMONSET_MOUNTS), paths - set(DAEMONSET_MOUNTS)


@pytest.mark.parametrize("command", [["plugin"], ["dra", "--node-name", "n"]])
def test_a_relative_cdi_dir_is_refused_where_no_runtime_would_look(command: list[str]) -> None:
    with pytest.raises(UsageError, match="--cdi-dir: 'relcdi': must be an absolute path"):
        parse([*command, "--cdi-dir", "relcdi"], {})
    with pytest.raises(UsageError, match="GPUPPETTI_CDI_DIR='relcdi': must be an absolute path"):
        parse(command, {"GPUPPETTI_CDI_DIR": "relcdi"})
    assert parse([*command, "--cdi-dir", "/etc/cdi"], {}).cdi_dir == Path("/etc/cdi")
