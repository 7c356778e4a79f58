"""gpuppetti top: a node's GPUs and the slices containers hold of them, live, from a running daemon's endpoint.

Like nvidia-smi for slices: each GPU with its slices, who holds each (namespace/pod/container), the memory they use
of their budget as a bar, and how long their submits have waited for their share of the GPU's time. It reads the
daemon's /v1/gpus and /v1/slices (the same figures /metrics exports), so it works from anywhere the endpoint is
reachable, and inside the daemon's pod through `kubectl exec`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from rich.console import Console, Group, RenderableType
from rich.text import Text

from gpuppetti.base.httpclient import FetchError, get
from gpuppetti.base.quantity import format_bytes
from gpuppetti.base.tables import Column, fit
from gpuppetti.node.httpserver import GPUS_PATH, SLICES_PATH
from gpuppetti.node.report import records_problem

BAR_WIDTH = 10


class TopError(Exception):
    """The endpoint cannot be read, or is not a gpuppetti daemon's; the message says which."""


@dataclass(frozen=True)
class View:
    url: str
    gpus: list[dict[str, Any]]
    slices: list[dict[str, Any]]
    at: float

    def document(self) -> dict[str, Any]:
        return {"from": self.url, "gpus": self.gpus, "slices": self.slices}


def _slices_problem(records: Any) -> str | None:
    if not isinstance(records, list):
        return "not a list"
    keys = {"namespace", "pod", "container", "gpu", "unit", "budget_bytes", "used_bytes", "compute_wait_seconds"}
    for index, record in enumerate(records):
        if not isinstance(record, dict) or not keys <= set(record):
            return f"item {index} is not a slice"
    return None


async def _json(url: str, path: str) -> Any:
    not_ours = f"{url} is not a gpuppetti plugin or DRA driver's HTTP endpoint (its --http-address)"
    try:
        reply = await get(url.rstrip("/") + path, timeout=10)
    except FetchError as exc:
        raise TopError(str(exc)) from None
    if reply.status != 200:
        raise TopError(f"{not_ours}: {path} answered {reply.status}")
    try:
        return json.loads(reply.body)
    except ValueError:
        raise TopError(f"{not_ours}: {path} answered something that is not JSON") from None


async def fetch(url: str) -> View:
    """What the daemon at ``url`` serves now. Raises TopError."""
    gpus, slices = await asyncio.gather(_json(url, GPUS_PATH), _json(url, SLICES_PATH))
    for path, problem in ((GPUS_PATH, records_problem(gpus)), (SLICES_PATH, _slices_problem(slices))):
        if problem is not None:
            raise TopError(f"{url}: {path} answered JSON that is not what gpuppetti serves ({problem})")
    return View(url, gpus, slices, time.time())


def bar(used: int, budget: int, width: int = BAR_WIDTH) -> Text:
    """Memory used of a budget, as a bar; a whole GPU (budget 0) has none."""
    if budget <= 0:
        return Text("whole GPU".ljust(width), style="dim")
    share = min(used / budget, 1.0)
    filled = round(share * width)
    style = "red" if share >= 0.9 else "yellow" if share >= 0.7 else "green"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def _holder(record: dict[str, Any]) -> str:
    parts = [record["namespace"], record["pod"], record["container"]]
    named = "/".join(part for part in parts if part)
    return named or "(not known yet)"


def render(view: View, width: int) -> RenderableType:
    """The view at ``width`` columns: a line per GPU, then a table of the slices held."""
    lines: list[RenderableType] = [Text.assemble(("gpuppetti top", "bold"), f"  {view.url}  ",
                                                 (time.strftime("%H:%M:%S", time.localtime(view.at)), "dim"))]
    held: dict[str, list[dict[str, Any]]] = {}
    for record in view.slices:
        held.setdefault(record["gpu"], []).append(record)
    for gpu in view.gpus:
        slices = held.get(gpu["id"], [])
        used = sum(record["used_bytes"] for record in slices)
        lines.append(Text.assemble(
            (gpu["id"], "bold"), f"  {gpu['model']}  {format_bytes(gpu['memory_bytes'])}  ",
            (gpu["health"], "green" if gpu["health"] == "Healthy" else "red"),
            f"  {len(slices)} of {gpu['replicas'] or 1} slice(s) held, {format_bytes(used)} in use",
            f"  enforced by {gpu.get('enforced_by') or 'none'}"))
    if not view.slices:
        lines.append(Text("no slice is held by a container (or slices are not enforced here)", style="dim"))
        return Group(*lines)
    columns = [Column("GPU"), Column("unit", 2), Column("held by"), Column("memory"), Column("used", 3, "right"),
               Column("budget", 3, "right"), Column("waited", 1, "right")]
    rows: list[Sequence[RenderableType]] = [
        [record["gpu"] or "-", record["unit"] or "-", _holder(record),
         bar(record["used_bytes"], record["budget_bytes"]), format_bytes(record["used_bytes"]),
         format_bytes(record["budget_bytes"]) if record["budget_bytes"] else "-",
         f"{record['compute_wait_seconds']:.1f}s"]
        for record in sorted(view.slices, key=lambda r: (r["gpu"], r["unit"]))]
    table, dropped = fit(Console(width=width), columns, rows, width)
    lines.append(table)
    if dropped:
        lines.append(Text(f"(left out at this width: {', '.join(dropped)})", style="dim"))
    return Group(*lines)


async def watch(console: Console, url: str, interval: float) -> None:
    """Redraw every ``interval`` seconds until interrupted; an endpoint that stops answering is said, not fatal."""
    from rich.live import Live

    with Live(console=console, auto_refresh=False, screen=False) as live:
        while True:
            try:
                view: RenderableType = render(await fetch(url), console.width)
            except TopError as exc:
                view = Text(f"gpuppetti top: {exc}; trying again", style="red")
            live.update(view, refresh=True)
            await asyncio.sleep(interval)
