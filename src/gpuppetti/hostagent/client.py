"""The plugin's side of the host agent: the Mac's GPU facts, fetched over HTTP and kept when the agent is gone.

Nothing waits for the agent: the plugin starts, registers and serves with the config's facts, and takes the
agent's once they arrive. Each fetch has a total deadline and a size cap, so an agent that answers slowly, or
answers far too much, costs the plugin neither time nor memory.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from gpuppetti.base.httpclient import FetchError, get
from gpuppetti.discovery import HostFacts
from gpuppetti.hostagent import API_PATH

log = logging.getLogger(__name__)

# The whole exchange, connect to last byte.
TIMEOUT_S = 5.0
# An agent serves a few hundred bytes; anything near this is not an agent.
MAX_ANSWER_BYTES = 256 * 1024
STALE = "host-agent (stale)"


class AgentError(Exception):
    pass


def facts_from(document: Any, url: str) -> HostFacts:
    """The first Apple GPU of an agent's /v1/gpus document. Raises AgentError when it is not one."""
    if not isinstance(document, dict) or not isinstance(document.get("gpus"), list):
        raise AgentError(f"the answer of {url} is not a gpuppetti host agent's {API_PATH} document")
    apple = [gpu for gpu in document["gpus"] if isinstance(gpu, dict) and gpu.get("vendor") == "apple"]
    if not apple:
        raise AgentError(f"the host agent at {url} reports no Apple GPU ({document.get('error') or 'none found'})")
    gpu = apple[0]

    def number(key: str) -> int | None:
        value = gpu.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

    return HostFacts(
        model=str(gpu.get("model") or "Apple GPU"),
        cores=number("cores"),
        # What the GPU may use without hurting performance, where Metal said; else the unified memory.
        memory_bytes=number("recommended_max_working_set_bytes") or number("unified_memory_bytes"),
        utilization_percent=number("utilization_percent"),
        in_use_memory_bytes=number("in_use_memory_bytes"),
        source="host-agent",
    )


async def fetch(url: str, token: str, timeout: float = TIMEOUT_S) -> HostFacts:
    """Ask the agent at ``url``. Raises AgentError saying what went wrong."""
    target = url.rstrip("/") + API_PATH
    try:
        reply = await get(target, {"Authorization": f"Bearer {token}"}, timeout, MAX_ANSWER_BYTES)
    except FetchError as exc:
        raise AgentError(f"the host agent: {exc}") from None
    if reply.status == 503:
        try:
            why = json.loads(reply.body).get("error")
        except (ValueError, AttributeError):
            why = None
        raise AgentError(f"the host agent at {url} has found no GPU ({why or 'it says no more'})")
    if reply.status != 200:
        hint = " (is the token in the Secret the agent's?)" if reply.status == 401 else ""
        raise AgentError(f"the host agent at {url} answered {reply.status}{hint}")
    try:
        document = json.loads(reply.body)
    except ValueError:
        raise AgentError(f"the answer of {url} is not JSON") from None
    return facts_from(document, url)


class HostAgentSource:
    """The last good facts, kept (marked stale) when the agent stops answering."""

    def __init__(self, url: str, token_file: Path) -> None:
        self.url = url
        self.token_file = token_file
        self._facts: HostFacts | None = None
        self.last_error: str | None = None

    def current(self) -> HostFacts | None:
        return self._facts

    def _token(self) -> str:
        try:
            return self.token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise AgentError(f"cannot read the host agent token {self.token_file}: {exc}") from exc

    async def ask(self) -> HostFacts:
        """Ask the agent once, with the token. Raises AgentError saying what went wrong."""
        return await fetch(self.url, self._token())

    async def fetch_once(self) -> HostFacts | None:
        """Ask the agent; on failure keep the last good facts, marked stale. Returns what is current now."""
        try:
            facts = await self.ask()
        except AgentError as exc:
            if self._facts is not None and self._facts.source != STALE:
                log.warning("%s; keeping the facts it last gave (%s), marked stale", exc, self._facts.model)
                self._facts = dataclasses.replace(self._facts, source=STALE)
            elif self._facts is None and self.last_error != str(exc):
                log.warning("%s; serving the config's virtio facts until it does", exc)
            self.last_error = str(exc)
            return self._facts
        if self._facts is None or self._facts.source == STALE:
            log.info("host agent at %s: %s, %s cores", self.url, facts.model, facts.cores)
        self._facts = facts
        self.last_error = None
        return facts

    async def poll(self, interval: float, changed: Callable[[], Awaitable[None]]) -> None:
        """Fetch now and every ``interval`` seconds; call ``changed`` when the facts (or their staleness) change."""
        previous: HostFacts | None = None
        while True:
            facts = await self.fetch_once()
            if facts != previous:
                await changed()
            previous = facts
            await asyncio.sleep(interval)
