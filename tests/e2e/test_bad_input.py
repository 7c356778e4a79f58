"""Every command with the mistakes users make: one line that starts ``gpuppetti:`` and names the flag, env var or
key, the README's exit code, no traceback, and nothing started or written."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import TWO_M3_MAX, PluginProcess, run_cli, run_here

pytestmark = pytest.mark.e2e

GPU_CONFIG = "version: v1\nsimulated:\n  gpus:\n    - {model: X, vendor: apple, cores: 8}\n"
TYPO_CONFIG = GPU_CONFIG + "sharing:\n  timeSlicing:\n    resources:\n      - {name: apple.com/gpus, replicas: 4}\n"

# (id, arguments, env, exit code, what the line must say). "{tmp}" is the test's directory.
CASES = [
    ("log-level-env", ["discover"], {"GPUPPETTI_LOG_LEVEL": "verbose"}, 2, "GPUPPETTI_LOG_LEVEL='verbose'"),
    ("log-level-env-plugin", ["plugin"], {"GPUPPETTI_LOG_LEVEL": "verbose"}, 2, "GPUPPETTI_LOG_LEVEL"),
    ("log-level-flag", ["dra", "--log-level", "loud"], {}, 2, "--log-level"),
    ("host-agent-no-scheme-discover", ["discover", "--host-agent", "host.minikube.internal"], {}, 2,
     "--host-agent: 'host.minikube.internal': expected a URL starting with http://"),
    ("host-agent-no-scheme-plugin", ["plugin", "--host-agent", "host.minikube.internal"], {}, 2, "--host-agent"),
    ("host-agent-env", ["plugin"], {"GPUPPETTI_HOST_AGENT": "host.minikube.internal:9410"}, 2,
     "GPUPPETTI_HOST_AGENT="),
    ("backend-env", ["plugin"], {"GPUPPETTI_BACKEND": "rocm"}, 2, "GPUPPETTI_BACKEND='rocm': must be one of"),
    ("backend-flag", ["plugin", "--backend", "rocm"], {}, 2, "--backend: 'rocm': must be one of"),
    ("http-address-flag", ["plugin", "--http-address", "nonsense"], {}, 2, "--http-address"),
    ("http-address-env", ["dra", "--node-name", "n"], {"GPUPPETTI_HTTP_ADDRESS": "nonsense"}, 2,
     "GPUPPETTI_HTTP_ADDRESS='nonsense'"),
    ("host-root-missing", ["plugin", "--host-root", "{tmp}/no-such-root"], {}, 2, "--host-root"),
    ("host-root-env", ["discover"], {"GPUPPETTI_HOST_ROOT": "{tmp}/no-such-root"}, 2, "GPUPPETTI_HOST_ROOT"),
    ("label-node-without-node", ["plugin", "--label-node"], {}, 2, "--label-node needs this node's name"),
    ("label-node-env", ["plugin"], {"GPUPPETTI_LABEL_NODE": "maybe"}, 2, "GPUPPETTI_LABEL_NODE='maybe'"),
    ("empty-device-plugin-dir", ["plugin", "--device-plugin-dir", ""], {}, 2, "--device-plugin-dir"),
    ("dra-without-node", ["dra"], {}, 2, "the node's name is required"),
    ("dra-bad-node", ["dra", "--node-name", "Not_A_Node"], {}, 2, "--node-name: 'Not_A_Node': is not a node name"),
    ("dra-node-env", ["dra"], {"NODE_NAME": "Not_A_Node"}, 2, "NODE_NAME='Not_A_Node'"),
    ("api-timeout-zero", ["dra", "--node-name", "n", "--api-timeout", "0"], {}, 2, "--api-timeout"),
    ("api-timeout-env", ["dra", "--node-name", "n"], {"GPUPPETTI_API_TIMEOUT": "soon"}, 2,
     "GPUPPETTI_API_TIMEOUT='soon'"),
    ("kubeconfig-missing", ["dra", "--node-name", "n", "--kubeconfig", "{tmp}/no-kubeconfig"], {}, 2,
     "--kubeconfig"),
    ("kubeconfig-env", ["dra", "--node-name", "n"], {"KUBECONFIG": "{tmp}/a:{tmp}/b"}, 2,
     "KUBECONFIG='{tmp}/a:{tmp}/b': none of these files exists"),
    ("config-typo", ["plugin", "--config", "{tmp}/typo.yaml"], {}, 2,
     "sharing.timeSlicing.resources[0].name: 'apple.com/gpus' is not a resource any GPU is offered under; did you "
     "mean apple.com/gpu?"),
    ("config-missing", ["discover", "--config", "{tmp}/missing.yaml"], {}, 2, "cannot read the config file"),
    ("agent-interval-negative", ["host-agent", "--interval", "-1"], {}, 2, "--interval: '-1': must be more than 0"),
    ("agent-interval-zero", ["host-agent", "--interval", "0"], {}, 2, "--interval"),
    ("agent-listen", ["host-agent", "--listen", "bad", "--token-file", "{tmp}/token"], {}, 2, "--listen"),
    ("agent-listen-env", ["host-agent", "--token-file", "{tmp}/token"], {"GPUPPETTI_HOST_AGENT_LISTEN": "bad"}, 2,
     "GPUPPETTI_HOST_AGENT_LISTEN='bad'"),
    ("agent-token-empty", ["host-agent", "--token-file", "{tmp}/empty-token"], {}, 2,
     "--token-file {tmp}/empty-token: is empty"),
    ("agent-token-dir", ["host-agent", "--token-file", "{tmp}"], {}, 2, "is a directory"),
    ("agent-namespace", ["host-agent", "--namespace", "Bad_NS"], {}, 2, "--namespace"),
    ("discover-from-not-a-url", ["discover", "--from", "localhost"], {}, 2, "--from: 'localhost': expected a URL"),
    ("discover-from-nobody", ["discover", "--from", "http://127.0.0.1:1"], {}, 1, "did not answer"),
    ("manifests-dra-replicas", ["manifests", "--mode", "dra", "--replicas", "4"], {}, 2,
     "--replicas is for the device plugin"),
    ("manifests-dra-label-node", ["manifests", "--mode", "dra", "--label-node"], {}, 2,
     "--label-node is for the device plugin"),
    ("manifests-empty-image", ["manifests", "--image", ""], {}, 2, "--image: '': must not be empty"),
    ("manifests-bad-image", ["manifests", "--image", "Not An Image"], {}, 2, "--image"),
    ("manifests-namespace", ["manifests", "--namespace", "GPU_Stuff"], {}, 2, "--namespace: 'GPU_Stuff'"),
    ("manifests-replicas-zero", ["manifests", "--replicas", "0"], {}, 2, "--replicas: '0': must be from 1 to 1024"),
    ("manifests-mode", ["manifests", "--mode", "both"], {}, 2, "--mode"),
    ("manifests-config-and-replicas", ["manifests", "--config", "{tmp}/gpu.yaml", "--replicas", "2"], {}, 2,
     "--replicas applies to the generated config"),
    ("demo-image-without-runtime", ["demo", "--image", "busybox"], {}, 2, "--image is the image the sandbox runs"),
    ("demo-runtime", ["demo", "--runtime", "docker"], {}, 2, "--runtime"),
    ("demo-config-without-gpus", ["demo", "--config", "{tmp}/no-gpus.yaml"], {}, 2, "has no simulated GPUs"),
    ("doctor-daemon", ["doctor", "--daemon", "localhost"], {}, 2, "--daemon: 'localhost': expected a URL"),
    ("doctor-mode", ["doctor"], {"GPUPPETTI_MODE": "all"}, 2, "GPUPPETTI_MODE='all'"),
    ("unknown-command", ["serve"], {}, 2, "unknown command 'serve'"),
    ("no-command", [], {}, 2, "the following arguments are required: COMMAND"),
    ("unknown-flag", ["plugin", "--replicas", "4"], {}, 2, "unrecognized arguments: --replicas 4"),
]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "typo.yaml").write_text(TYPO_CONFIG)
    (tmp_path / "gpu.yaml").write_text(GPU_CONFIG)
    (tmp_path / "no-gpus.yaml").write_text("version: v1\nbackend: simulated\n")
    (tmp_path / "empty-token").write_text("")
    return tmp_path


# Run in this process, as the command line runs them; these also through the command as users run it, in a
# process of its own: a daemon's, a setting from the environment, and argparse's own complaint.
IN_A_PROCESS = ("log-level-env-plugin", "config-typo", "unknown-flag")


@pytest.mark.parametrize(("args", "env", "code", "says"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_mistake_is_one_line_and_the_right_exit_code(
    workdir: Path, args: list[str], env: dict[str, str], code: int, says: str
) -> None:
    _check(workdir, args, env, code, says, run_here)


@pytest.mark.parametrize(("args", "env", "code", "says"), [c[1:] for c in CASES if c[0] in IN_A_PROCESS],
                         ids=[c[0] for c in CASES if c[0] in IN_A_PROCESS])
def test_a_mistake_is_one_line_and_the_right_exit_code_from_the_command(
    workdir: Path, args: list[str], env: dict[str, str], code: int, says: str
) -> None:
    _check(workdir, args, env, code, says, run_cli)


def _check(workdir: Path, args: list[str], env: dict[str, str], code: int, says: str,
           run: Callable[..., subprocess.CompletedProcess[str]]) -> None:
    def fill(text: str) -> str:
        return text.replace("{tmp}", str(workdir))

    before = sorted(path.name for path in workdir.iterdir())
    result = run(*map(fill, args), env={k: fill(v) for k, v in env.items()})
    output = result.stdout + result.stderr
    assert "Traceback" not in output, output
    assert result.returncode == code, output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpuppetti: "), lines[0]
    assert fill(says) in lines[0], lines[0]
    assert sorted(path.name for path in workdir.iterdir()) == before, "a mistake must not create anything"


class _NotGpuppetti(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"status": "ok"}).encode() if self.path == "/v1/gpus" else b"<html>nope</html>"
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def other_server() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotGpuppetti)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_discover_from_a_server_that_is_not_gpuppetti(other_server: str) -> None:
    result = run_here("discover", "--from", other_server)
    assert result.returncode == 1
    [line] = result.stderr.strip().splitlines()
    assert line == (f"gpuppetti: {other_server} is not a gpuppetti plugin or DRA driver's HTTP endpoint (its "
                    "--http-address): /v1/gpus answered JSON that is not a list of GPUs (a JSON dict, not a list)")


class _NoApiServer(http.server.BaseHTTPRequestHandler):
    """A web server that answers 404 to everything, without a Content-Type."""

    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("Content-Length", "9")
        self.end_headers()
        self.wfile.write(b"not found")

    do_GET = do_POST = do_PATCH = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_install_against_a_server_that_is_no_api_server_says_what_answered(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoApiServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(f"apiVersion: v1\nkind: Config\ncurrent-context: x\n"
                              f"clusters: [{{name: c, cluster: {{server: '{url}'}}}}]\n"
                              "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
                              "users: [{name: u, user: {token: t}}]\n")
        result = run_here("install", "--kubeconfig", str(kubeconfig))
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode == 1, result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line == (f"gpuppetti: cannot reach the cluster of context x at {url}: listing Nodes: 404 Not Found, an "
                    "answer without a Content-Type: not a Kubernetes API server's answer (is this the API server's "
                    "address?)"), line


# A FIFO as the config: opened and read as a file, it blocked until a writer came, in a thread that a stop could
# neither cancel nor leave behind: start-up hung with SIGTERM ignored, a reload blocked every later one and SIGTERM.


async def test_a_fifo_as_the_config_is_refused_at_start(plugin_dir: Path) -> None:
    fifo = plugin_dir.parent / "fifo.yaml"
    os.mkfifo(fifo)
    plugin = PluginProcess(None, plugin_dir, "--config", str(fifo))
    try:
        code = await plugin.wait(timeout=30)
    finally:
        await plugin.close()
    assert code == 2, plugin.log()
    assert f"{fifo}: the config must be a regular file, and this is a FIFO" in plugin.log()
    assert "Traceback" not in plugin.log()


async def test_a_fifo_as_the_config_is_refused_at_reload_and_sigterm_still_stops(plugin_dir: Path) -> None:
    plugin = PluginProcess(TWO_M3_MAX, plugin_dir)
    try:
        await plugin.wait_for_log("found 2 GPU(s)")
        assert plugin.config_path is not None
        plugin.config_path.unlink()
        os.mkfifo(plugin.config_path)
        plugin.send(signal.SIGHUP)
        await plugin.wait_for_log("this is a FIFO")
        assert "keeping the previous config" in plugin.log()
        # The next reload is not held up by the last one.
        plugin.config_path.unlink()
        plugin.write_config(TWO_M3_MAX)
        plugin.send(signal.SIGHUP)
        await plugin.wait_for_log("config reloaded")
        assert await plugin.stop(signal.SIGTERM, timeout=15) == 0
    finally:
        await plugin.close()
