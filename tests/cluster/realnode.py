"""The real single-node Kubernetes of the cluster tier: bring-up, kubectl, and gpuppetti processes on the host.

The node comes from the shared `realnode` kit (kubelet, API server, scheduler, controller manager and containerd
with CDI, all on loopback). Everything here talks to it the way a user would: kubectl for the API, the kit's
`ctl.sh` for processes, so that its `down.sh` stops whatever a test left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from tests import helpers

REPO = Path(__file__).resolve().parents[2]
# Where the kit lives beside the repository; REALNODE_KIT points elsewhere.
# The venv the project's image is packed from (the wheel installed as a user installs it), at this path in the image.
IMAGE_VENV = Path(tempfile.gettempdir()) / "gpuppetti-cluster-image-venv"
KIT = Path(os.environ.get("REALNODE_KIT", REPO.parent / "shared" / "realnode"))
# A state dir of the suite's own, fixed so that a re-run reuses the unpacked binaries (FRESH=1 wipes the rest).
STATE_DIR = Path(os.environ.get("GPUPPETTI_REALNODE_DIR", "/tmp/gpuppetti-cluster-tier"))
NODE = "localhost"
IMAGE = "localhost/gpuppetti:dev"
BUSYBOX = "localhost/busybox:1.36"
CDI_DIR = Path("/var/run/cdi")
KUBELET_DIR = Path("/var/lib/kubelet")
T = TypeVar("T")
START_MARK = "---- gpuppetti"
# Only one real node can run on a machine: whoever brings one up (this suite, the scale bench) holds this lock
# until it is down, and another waits for it rather than failing on the node's ports.
LOCK = Path(tempfile.gettempdir()) / "gpuppetti-realnode.lock"


def machine_lock() -> contextlib.AbstractContextManager[None]:
    return helpers.machine_lock(LOCK, "waiting for another real node on this machine to go down")


def why_not() -> str | None:
    """Why the real node cannot run here, in one line; None when it can."""
    if os.geteuid() != 0:
        return "the real node needs root (kubelet, containerd and runc run as root)"
    if not (KIT / "up.sh").is_file():
        return f"no real node kit at {KIT} (set REALNODE_KIT to its directory)"
    return None


class WaitTimeout(AssertionError):
    pass


class KubectlError(AssertionError):
    pass


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60.0, interval: float = 0.5) -> T:
    """Poll ``probe`` until it returns something other than None/False; fail naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            value = probe()
        except KubectlError as exc:
            value, last = None, str(exc)
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            suffix = f" (last: {last})" if last else ""
            raise WaitTimeout(f"timed out after {timeout:.0f}s waiting for {what}{suffix}")
        time.sleep(interval)


@dataclass
class Daemon:
    """A gpuppetti process on the host, started through the kit's ctl.sh (so that down.sh stops it too)."""

    node: RealNode
    name: str

    @property
    def log_path(self) -> Path:
        return self.node.dir / "logs" / f"{self.name}.log"

    def log(self) -> str:
        """What this run of the daemon logged: the file keeps earlier runs' lines above the last start mark."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return text[text.rfind(START_MARK):] if START_MARK in text else text

    def pid(self) -> int | None:
        result = self.node.ctl("pid", self.name, check=False)
        text = result.stdout.strip()
        return int(text) if text.isdigit() else None

    def alive(self) -> bool:
        return self.pid() is not None

    def signal(self, signum: int) -> None:
        pid = self.pid()
        assert pid is not None, f"{self.name} is not running:\n{self.log()[-3000:]}"
        os.kill(pid, signum)

    def stop(self) -> None:
        self.node.ctl("stop", self.name)

    def kill9(self) -> None:
        self.node.ctl("kill9", self.name)

    def start(self) -> None:
        self.node.ctl("start", self.name)

    def wait_log(self, text: str | re.Pattern[str], timeout: float = 30.0, after: int = 0) -> str:
        """Wait until the log (from byte ``after``) holds ``text``; returns the matching line."""
        def found() -> str | None:
            log = self.log()[after:]
            for line in log.splitlines():
                if (text.search(line) if isinstance(text, re.Pattern) else text in line):
                    return line
            return None
        return wait_for(f"{text!r} in {self.log_path}", found, timeout, 0.2)

    def http_url(self, timeout: float = 30.0) -> str:
        marker = "/metrics on http://"
        self.wait_log(marker, timeout)
        # The newest: a restarted daemon logs its new address below the old one.
        line = [line for line in self.log().splitlines() if marker in line][-1]
        return "http://" + line.split(marker, 1)[1].strip()

    def healthz(self) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.http_url() + "/healthz", timeout=5) as answer:
                return answer.status, answer.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()
        except (urllib.error.URLError, OSError) as exc:
            # Not listening yet (or a restarted daemon whose new address is not logged yet).
            return 0, str(exc)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait for /healthz to answer 200: registered with the kubelet (and, for DRA, slices published)."""
        wait_for(f"{self.name} ready (/healthz 200)", lambda: self.healthz()[0] == 200, timeout, 0.2)


@dataclass
class RealNode:
    dir: Path
    kit: Path = KIT
    name: str = NODE
    _images: set[str] = field(default_factory=set)

    # -- the node itself -------------------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "REALNODE_DIR": str(self.dir), "KUBECONFIG": str(self.kubeconfig),
                "PATH": f"{self.dir / 'bin'}:{os.environ.get('PATH', '')}"}

    @property
    def kubeconfig(self) -> Path:
        return self.dir / "admin.kubeconfig"

    def up(self) -> None:
        print(f"cluster tier: bringing up the real node in {self.dir} (etcd, API server, scheduler, controller "
              "manager, containerd, kubelet; about a minute, more if Debian packages are installed first)",
              file=sys.stderr)
        code, output = self._kit("up.sh", {"FRESH": "1"}, 600)
        if code != 0:
            raise RuntimeError(f"realnode up.sh failed ({code}):\n{output}")

    def down(self) -> None:
        print("cluster tier: taking the real node down (its processes, pods' containers and mounts; its data purged; "
              "about a minute)", file=sys.stderr)
        self._kit("down.sh", {"PURGE": "1"}, 300)

    def _kit(self, script: str, env: dict[str, str], timeout: float) -> tuple[int, str]:
        """Run one of the kit's scripts, saying each line it prints as it comes (on stderr: ``pytest -s`` and the
        logs show what the node waits for); its exit code and output. Killed after ``timeout``."""
        start = time.monotonic()
        process = subprocess.Popen(["bash", str(self.kit / script)], env={**self.env, **env}, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
        # The script and whatever it started that still runs (an apt-get holding the pipe) go together.
        timer = threading.Timer(timeout, os.killpg, (process.pid, signal.SIGKILL))
        timer.start()
        lines = []
        try:
            assert process.stdout is not None
            for line in process.stdout:
                lines.append(line)
                print(f"cluster tier: {script}: {line.rstrip()}", file=sys.stderr)
            code = process.wait()
        finally:
            timer.cancel()
        print(f"cluster tier: {script} ended ({code}) after {time.monotonic() - start:.0f}s", file=sys.stderr)
        return code, "".join(lines)

    def ctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(self.kit / "ctl.sh"), *args], env=self.env, capture_output=True,
                              text=True, timeout=60, check=check)

    def component_log(self, name: str) -> str:
        return (self.dir / "logs" / f"{name}.log").read_text(errors="replace")

    # -- kubectl ---------------------------------------------------------------------------------------------

    def kubectl(self, *args: str, input: str | None = None, check: bool = True, timeout: float = 60) -> str:
        result = subprocess.run([str(self.dir / "bin" / "kubectl"), *args], env=self.env, input=input,
                                capture_output=True, text=True, timeout=timeout, check=False)
        if check and result.returncode != 0:
            raise KubectlError(f"kubectl {' '.join(args)}: exit {result.returncode}: {result.stderr.strip()}")
        return result.stdout

    def get(self, kind: str, name: str | None = None, namespace: str = "default", **selectors: str) -> Any:
        args = ["get", kind, *([name] if name else []), "-o", "json", "-n", namespace]
        for flag, value in selectors.items():
            args += [f"--{flag.replace('_', '-')}", value]
        return json.loads(self.kubectl(*args))

    def maybe_get(self, kind: str, name: str, namespace: str = "default") -> Any:
        out = self.kubectl("get", kind, name, "-o", "json", "-n", namespace, "--ignore-not-found")
        return json.loads(out) if out.strip() else None

    def apply(self, objects: Iterable[dict[str, Any]] | str) -> None:
        """Apply objects; those without a namespace go to default."""
        text = objects if isinstance(objects, str) else yaml.safe_dump_all(list(objects))
        self.kubectl("apply", "-f", "-", input=text)

    def delete(self, *args: str, wait: bool = True) -> None:
        self.kubectl("delete", "--ignore-not-found", f"--wait={str(wait).lower()}", *args, timeout=180)

    def node_status(self) -> Any:
        return self.get("node", self.name)["status"]

    def allocatable(self, resource: str) -> int | None:
        value = self.node_status().get("allocatable", {}).get(resource)
        return int(value) if value is not None else None

    def wait_allocatable(self, resource: str, count: int, timeout: float = 60.0) -> None:
        wait_for(f"allocatable {resource} = {count} (now {self.allocatable(resource)})",
                 lambda: self.allocatable(resource) == count, timeout)

    def pod(self, name: str, namespace: str = "default") -> Any:
        return self.get("pod", name, namespace)

    def phase(self, name: str, namespace: str = "default") -> str:
        return str(self.pod(name, namespace)["status"].get("phase", ""))

    def wait_running(self, *names: str, namespace: str = "default", timeout: float = 90.0) -> None:
        for name in names:
            def running(name: str = name) -> bool:
                pod = self.pod(name, namespace)
                phase = str(pod["status"].get("phase", ""))
                if phase in ("Failed", "Succeeded"):
                    raise AssertionError(f"pod {name} ended {phase}: {pod['status']}\n{self.events(name)}")
                return phase == "Running"
            try:
                wait_for(f"pod {name} Running", running, timeout)
            except WaitTimeout as exc:
                raise WaitTimeout(f"{exc}\n{self.events(name, namespace)}") from None

    def events(self, name: str, namespace: str = "default") -> str:
        return self.kubectl("get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={name}",
                            "-o", "custom-columns=REASON:.reason,MESSAGE:.message", check=False)

    def logs(self, pod: str, namespace: str = "default", container: str | None = None) -> str:
        args = ["logs", pod, "-n", namespace, *(["-c", container] if container else [])]
        return self.kubectl(*args)

    def env_of(self, pod: str, namespace: str = "default", prefix: str = "GPUPPETTI_") -> dict[str, str]:
        """The env a pod's container printed (its command runs `env` first), keys starting with ``prefix``."""
        def printed() -> dict[str, str] | None:
            lines = self.logs(pod, namespace).splitlines()
            env = dict(line.split("=", 1) for line in lines if "=" in line and line.startswith(prefix))
            return env or None
        return wait_for(f"the env printed by pod {pod}", printed, 30)

    def delete_all_pods(self, namespace: str = "default") -> None:
        self.delete("pods", "--all", "-n", namespace, "--grace-period=1")

    # -- images and processes --------------------------------------------------------------------------------

    def import_image(self, archive: Path) -> None:
        ctr = [str(self.dir / "bin" / "ctr"), "--address", str(self.dir / "containerd" / "containerd.sock"),
               "-n", "k8s.io", "images", "import", "--all-platforms", str(archive)]
        subprocess.run(ctr, env=self.env, capture_output=True, text=True, timeout=300, check=True)

    def gpuppetti(self, name: str, *args: str) -> Daemon:
        """Start ``gpuppetti ARGS`` on the host as ``name``, from the venv running the tests."""
        program = Path(sys.executable).parent / "gpuppetti"
        if args and args[0] in ("plugin", "dra") and "--vulkan-layer-dir" not in args:
            # The node's state directory, which the suite's teardown removes, rather than the host's /var/lib.
            args = (*args, "--vulkan-layer-dir", str(self.dir / "vulkan"))
        daemon = Daemon(self, name)
        daemon.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(daemon.log_path, "a") as log:
            log.write(f"{START_MARK} {' '.join(args)}\n")
        self.ctl("run", name, str(program), *args, "--log-level", "debug")
        return daemon


def pod(name: str, *, command: str = "env; sleep 3600", limits: dict[str, Any] | None = None,
        claims: Sequence[tuple[str, str, str]] = (), image: str = BUSYBOX) -> dict[str, Any]:
    """A busybox pod that prints its env and sleeps. ``claims``: (name, 'template'|'claim', object name)."""
    container: dict[str, Any] = {"name": "c", "image": image, "imagePullPolicy": "Never",
                                 "command": ["sh", "-c", command]}
    spec: dict[str, Any] = {"terminationGracePeriodSeconds": 1, "containers": [container]}
    if limits:
        container["resources"] = {"limits": limits}
    if claims:
        container.setdefault("resources", {})["claims"] = [{"name": n} for n, _, _ in claims]
        spec["resourceClaims"] = [
            {"name": n, "resourceClaimTemplateName" if kind == "template" else "resourceClaimName": obj}
            for n, kind, obj in claims
        ]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def write_config(directory: Path, name: str, text: str) -> Path:
    path = directory / name
    path.write_text(text)
    return path


def clean_cdi(prefix: str) -> None:
    for entry in CDI_DIR.glob(f"{prefix}*"):
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
