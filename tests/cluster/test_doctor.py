"""``gpuppetti doctor`` against real container runtimes: the real node's containerd 2.3 (CDI on), the same
containerd with CDI switched off, and Debian's containerd 1.6, which has no CDI at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.cluster.realnode import RealNode
from tests.helpers import run_cli, short_tmpdir

DEBIAN_CONTAINERD = Path("/usr/bin/containerd")
SIMULATED = "version: v1\nsimulated:\n  gpus:\n    - {model: Apple M3 Max, vendor: apple, cores: 40, memory: 48Gi}\n"


def doctor(*args: str) -> tuple[int, dict[str, dict[str, Any]]]:
    result = run_cli("doctor", "--json", *args)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, {check["check"]: check for check in json.loads(result.stdout)}


def test_the_real_node_is_ready_for_both_modes(node: RealNode, workdir: Path) -> None:
    config = workdir / "sim.yaml"
    config.write_text(SIMULATED)
    code, checks = doctor("--config", str(config), "--runtime-endpoint", str(node.dir / "containerd/containerd.sock"))
    assert checks["container runtime"]["status"] == "ok", checks["container runtime"]
    assert checks["container runtime"]["detail"].startswith("containerd 2.3.4 (CRI v1)")
    assert checks["CDI in the runtime"]["status"] == "ok", checks["CDI in the runtime"]
    assert "/var/run/cdi" in checks["CDI in the runtime"]["detail"]
    # The real kubelet's sockets.
    assert checks["kubelet device plugins"]["status"] == "ok", checks["kubelet device plugins"]
    assert checks["kubelet plugin registry"]["status"] == "ok", checks["kubelet plugin registry"]
    failed = {name: check for name, check in checks.items() if check["status"] == "fail"}
    assert (code, failed) == (0, {})


class Containerd:
    """A containerd of its own, on sockets and state in a temporary directory, with the CRI config given."""

    def __init__(self, binary: Path, cri: str) -> None:
        self.dir = short_tmpdir("gp-ctrd-")
        self.socket = self.dir / "containerd.sock"
        config = self.dir / "config.toml"
        config.write_text(
            f'version = 2\nroot = "{self.dir}/root"\nstate = "{self.dir}/state"\n'
            f'[grpc]\n  address = "{self.socket}"\n[ttrpc]\n  address = "{self.socket}.ttrpc"\n'
            f'[plugins."io.containerd.grpc.v1.cri"]\n{cri}'
        )
        self.log = (self.dir / "containerd.log").open("wb")
        self.process = subprocess.Popen([str(binary), "--config", str(config)], stdout=self.log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not self.socket.exists():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"containerd did not start:\n{(self.dir / 'containerd.log').read_text()}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def debian_containerd() -> Iterator[Containerd]:
    if not DEBIAN_CONTAINERD.exists():
        pytest.skip("Debian's containerd 1.6 is not installed (apt-get install containerd)")
    version = subprocess.run([str(DEBIAN_CONTAINERD), "--version"], capture_output=True, text=True,
                             check=False).stdout
    if " 1.6." not in version:
        pytest.skip(f"{DEBIAN_CONTAINERD} is not containerd 1.6: {version.strip()}")
    runtime = Containerd(DEBIAN_CONTAINERD, "")
    yield runtime
    runtime.stop()


def test_debian_containerd_16_is_told_apart(realnode: RealNode, debian_containerd: Containerd) -> None:
    code, checks = doctor("--runtime-endpoint", f"unix://{debian_containerd.socket}")
    assert checks["container runtime"]["detail"].startswith("containerd 1.6.")
    cdi = checks["CDI in the runtime"]
    assert cdi["status"] == "fail", cdi
    assert "cannot apply CDI devices: DRA claims" in cdi["detail"]
    assert "upgrade containerd to 1.7 or newer" in cdi["fix"]
    assert code == 1


def test_containerd_23_with_cdi_switched_off(realnode: RealNode) -> None:
    runtime = Containerd(realnode.dir / "bin" / "containerd", "  enable_cdi = false\n")
    try:
        code, checks = doctor("--runtime-endpoint", str(runtime.socket))
    finally:
        runtime.stop()
    cdi = checks["CDI in the runtime"]
    assert (cdi["status"], code) == ("fail", 1), cdi
    assert cdi["detail"].startswith("CDI is off in containerd 2.3.4")
    assert "enable_cdi = true" in cdi["fix"]


def test_doctor_says_which_dra_features_the_cluster_allows(node: RealNode, workdir: Path) -> None:
    features = ("claim status", "device health in pod status", "plain limits through DRA",
                "consumable shares and partitions", "partitions in the counters layout")
    # An admin's kubeconfig: the API server's own gates, from its /metrics.
    _, checks = doctor("--mode", "dra", "--kubeconfig", str(node.kubeconfig))
    assert checks["cluster"]["detail"] == "Kubernetes v1.36.2; its feature gates read from the API server's /metrics"
    for feature in features:
        assert checks[f"cluster: {feature}"]["status"] == "ok", checks[f"cluster: {feature}"]
        assert " on; see it: kubectl " in checks[f"cluster: {feature}"]["detail"]
    # An account that may not read /metrics: the release's defaults, and it says so.
    node.kubectl("create", "serviceaccount", "doctor-reader", check=False)
    try:
        token = node.kubectl("create", "token", "doctor-reader").strip()
        config = yaml.safe_load(node.kubeconfig.read_text())
        config["users"] = [{"name": "reader", "user": {"token": token}}]
        for context in config["contexts"]:
            context["context"]["user"] = "reader"
        (workdir / "reader.kubeconfig").write_text(yaml.safe_dump(config))
        _, checks = doctor("--mode", "dra", "--kubeconfig", str(workdir / "reader.kubeconfig"))
        assert "assumed to be their defaults: its /metrics answered 403" in checks["cluster"]["detail"]
        assert checks["cluster: plain limits through DRA"]["detail"].startswith(
            "DRAExtendedResource on by default from 1.36")
    finally:
        node.kubectl("delete", "serviceaccount", "doctor-reader", "--ignore-not-found")
