"""The plugin's side of the host agent: the Mac's GPU facts, fetched over HTTP and kept when the agent is gone."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path

from gpuppetti.hostagent import API_PATH

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0


class AgentError(Exception):
    pass


@dataclass(frozen=True)
class AgentFacts:
    model: str
    cores: int | None
    memory_bytes: int | None
    utilization_percent: int | None
    in_use_memory_bytes: int | None
    fetched_at: float
    stale: bool = False

    @property
    def source(self) -> str:
        return "host-agent (stale)" if self.stale else "host-agent"


def fetch(url: str, token: str, timeout: float = TIMEOUT_S) -> AgentFacts:
    """The first Apple GPU the agent at ``url`` reports. Raises AgentError saying what went wrong."""
    request = urllib.request.Request(url.rstrip("/") + API_PATH, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            document = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        hint = " (is the token the agent printed in the Secret?)" if exc.code == 401 else ""
        raise AgentError(f"the host agent at {url} answered {exc.code}{hint}") from exc
    except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
        raise AgentError(f"the host agent at {url} did not answer: {getattr(exc, 'reason', exc)}") from exc
    apple = [gpu for gpu in document.get("gpus", []) if gpu.get("vendor") == "apple"]
    if not apple:
        raise AgentError(f"the host agent at {url} reports no Apple GPU ({document.get('error') or 'none found'})")
    gpu = apple[0]
    return AgentFacts(
        model=str(gpu.get("model") or "Apple GPU"),
        cores=gpu.get("cores"),
        # What the GPU may use without hurting performance, where Metal said; else the unified memory.
        memory_bytes=gpu.get("recommended_max_working_set_bytes") or gpu.get("unified_memory_bytes"),
        utilization_percent=gpu.get("utilization_percent"),
        in_use_memory_bytes=gpu.get("in_use_memory_bytes"),
        fetched_at=time.time(),
    )


class HostAgentSource:
    """The last good facts, read by the DRM backend (on a thread) and updated by ``poll`` (on the loop)."""

    def __init__(self, url: str, token_file: Path) -> None:
        self.url = url
        self.token_file = token_file
        self._facts: AgentFacts | None = None
        self._lock = threading.Lock()
        self.last_error: str | None = None

    def current(self) -> AgentFacts | None:
        with self._lock:
            return self._facts

    def _token(self) -> str:
        try:
            return self.token_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise AgentError(f"cannot read the host agent token {self.token_file}: {exc.strerror}") from exc

    def fetch_once(self) -> AgentFacts | None:
        """Ask the agent; on failure keep the last good facts, marked stale. Returns what is current now."""
        try:
            facts = fetch(self.url, self._token())
        except AgentError as exc:
            with self._lock:
                if self._facts is not None and not self._facts.stale:
                    log.warning("%s; keeping the facts it last gave (%s), marked stale", exc, self._facts.model)
                    self._facts = replace(self._facts, stale=True)
                elif self._facts is None and self.last_error != str(exc):
                    log.warning("%s; serving the config's virtio facts until it does", exc)
                self.last_error = str(exc)
                return self._facts
        with self._lock:
            if self._facts is None or self._facts.stale:
                log.info("host agent at %s: %s, %s cores", self.url, facts.model, facts.cores)
            self._facts = facts
            self.last_error = None
            return facts

    async def poll(self, interval: float, changed: Callable[[], Awaitable[None]]) -> None:
        """Fetch every ``interval`` seconds; call ``changed`` when the facts (or their staleness) change.

        The first fetch happened before the first discovery, so this starts by waiting.
        """
        previous = self.current()
        while True:
            await asyncio.sleep(interval)
            facts = await asyncio.to_thread(self.fetch_once)
            if _identity(facts) != _identity(previous):
                await changed()
            previous = facts


def _identity(facts: AgentFacts | None) -> tuple[object, ...] | None:
    if facts is None:
        return None
    return (facts.model, facts.cores, facts.memory_bytes, facts.stale, facts.utilization_percent,
            facts.in_use_memory_bytes)
