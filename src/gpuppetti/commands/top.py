"""gpuppetti top: a node's GPUs and the slices containers hold of them, live, from a running daemon's endpoint.

Like nvidia-smi for slices: each GPU with its slices, who holds each (namespace/pod/container), the memory they use
of their budget as a bar, and how long their submits have waited for their share of the GPU's time. It reads the
daemon's /v1/gpus and /v1/slices (the same figures /metrics exports), so it works from anywhere the endpoint is
reachable, and inside the daemon's pod through `kubectl exec`.

What an endpoint answers is validated into the records below before anything is shown, and every string in them
loses its control characters: whatever answers on the address given, the terminal gets text, never an escape
sequence (a colour, a cursor move, a clipboard write, a link) or a traceback.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from rich.console import Console, Group, RenderableType
from rich.text import Text

from gpuppetti.base.httpclient import FetchError, Unreachable, get
from gpuppetti.base.quantity import format_bytes
from gpuppetti.base.tables import Column, fit
from gpuppetti.node.httpserver import GPUS_PATH, SLICES_PATH

BAR_WIDTH = 10
TIMEOUT_S = 10.0
# Room for /v1/slices of 10,000 slices, even with the longest names Kubernetes allows (docs/observability.md has
# the sizes).
MAX_ANSWER_BYTES = 8 * 1024 * 1024
START_HINT = "start a daemon (gpuppetti plugin or gpuppetti dra), or `gpuppetti demo --keep-running`"

# C0 and DEL (an escape sequence starts with ESC, a line can be rewritten with CR or BS), C1 (CSI and OSC in one
# character), and the marks that reorder what follows them on the screen (bidi overrides, embeddings, isolates).
_UNSHOWN = dict.fromkeys([*range(0x20), *range(0x7F, 0xA0), 0x061C, 0x200E, 0x200F, *range(0x202A, 0x202F),
                          *range(0x2066, 0x206A)])


def printable(text: str) -> str:
    """``text`` without the characters a terminal would act on or reorder by."""
    return text.translate(_UNSHOWN)


Shown = Annotated[str, AfterValidator(printable)]
Bytes = Annotated[int, Field(ge=0)]


class _Record(BaseModel):
    # Strict: a number as a string, or a string as a number, is not what gpuppetti serves.
    model_config = ConfigDict(frozen=True, strict=True, extra="ignore")


class GpuRecord(_Record):
    """What top takes of a /v1/gpus record (node.report.gpu_record)."""

    id: Shown
    model: Shown
    health: Shown
    vendor: Shown = ""
    memory_bytes: Bytes | None = None
    resource: Shown | None = None
    replicas: Annotated[int, Field(ge=0)] | None = None
    slice_memory_bytes: Bytes | None = None
    # What holds its slices' memory (sharing.limits): vulkan-layer, nvml, dmem, a combination, or none.
    enforced_by: Shown | None = None


class SliceRecord(_Record):
    """A /v1/slices record (node.report.slice_records)."""

    namespace: Shown
    pod: Shown
    container: Shown
    gpu: Shown
    unit: Shown
    budget_bytes: Bytes
    used_bytes: Bytes
    compute_wait_seconds: Annotated[float, Field(ge=0)]


T = TypeVar("T")
_GPUS = TypeAdapter(list[GpuRecord])
_SLICES = TypeAdapter(list[SliceRecord])


class TopError(Exception):
    """The endpoint cannot be read, or is not a gpuppetti daemon's; the message says which."""


class NothingAnswers(TopError):
    """Nothing listens where the view was asked for: no daemon (or demo) runs there."""


@dataclass(frozen=True)
class View:
    url: str
    gpus: list[GpuRecord]
    slices: list[SliceRecord]
    at: float

    def document(self) -> dict[str, Any]:
        return {"from": printable(self.url), "gpus": [gpu.model_dump() for gpu in self.gpus],
                "slices": [record.model_dump() for record in self.slices]}


def _problem(exc: ValidationError) -> str:
    """The first thing wrong with an answer, in one line, placed by item and key (never quoting the answer)."""
    error = exc.errors(include_url=False, include_input=False)[0]
    place = ", ".join(f"item {part}" if isinstance(part, int) else str(part) for part in error["loc"])
    more = f"; {exc.error_count() - 1} more" if exc.error_count() > 1 else ""
    return f"{place + ': ' if place else ''}{error['msg'][:1].lower()}{error['msg'][1:]}{more}"


async def _records(url: str, path: str, adapter: TypeAdapter[list[T]]) -> list[T]:
    not_ours = f"{url} is not a gpuppetti plugin or DRA driver's HTTP endpoint (its --http-address)"
    try:
        reply = await get(url.rstrip("/") + path, timeout=TIMEOUT_S, limit=MAX_ANSWER_BYTES)
    except Unreachable as exc:
        raise NothingAnswers(f"nothing answers on {exc.address} ({url}): {START_HINT}") from None
    except FetchError as exc:
        raise TopError(str(exc)) from None
    if reply.status != 200:
        raise TopError(f"{not_ours}: {path} answered {reply.status}")
    try:
        return adapter.validate_json(reply.body)
    except ValidationError as exc:
        if any(error["type"] == "json_invalid" for error in exc.errors()):
            raise TopError(f"{not_ours}: {path} answered something that is not JSON") from None
        raise TopError(f"{url}: {path} answered JSON that is not what gpuppetti serves ({_problem(exc)})") from None


async def fetch(url: str) -> View:
    """What the daemon at ``url`` serves now. Raises TopError (NothingAnswers when nothing listens there)."""
    gpus, slices = await asyncio.gather(_records(url, GPUS_PATH, _GPUS), _records(url, SLICES_PATH, _SLICES))
    return View(url, gpus, slices, time.time())


def bar(used: int, budget: int, width: int = BAR_WIDTH) -> Text:
    """Memory used of a budget, as a bar; a whole GPU (budget 0) has none."""
    if budget <= 0:
        return Text("whole GPU".ljust(width), style="dim")
    share = min(used / budget, 1.0)
    filled = round(share * width)
    style = "red" if share >= 0.9 else "yellow" if share >= 0.7 else "green"
    return Text.assemble(("█" * filled, style), ("░" * (width - filled), "dim"))


def _holder(record: SliceRecord) -> str:
    named = "/".join(part for part in (record.namespace, record.pod, record.container) if part)
    return named or "(not known yet)"


def phrases(parts: Sequence[Text], width: int, indent: int = 2) -> Text:
    """``parts`` two spaces apart on a line of ``width`` columns; a part that would cross the edge starts the
    next line, indented, so that a line breaks between phrases, never inside one."""
    line = Text()
    column = 0
    for part in parts:
        if column and column + 2 + part.cell_len > width:
            line.append("\n" + " " * indent)
            column = indent
        elif column:
            line.append("  ")
            column += 2
        line.append_text(part)
        column += part.cell_len
    return line


def render(view: View, width: int) -> RenderableType:
    """The view at ``width`` columns: a line per GPU, then a table of the slices held."""
    lines: list[RenderableType] = [phrases(
        [Text("gpuppetti top", "bold"), Text(printable(view.url)),
         Text(time.strftime("%H:%M:%S", time.localtime(view.at)), "dim")], width)]
    held: dict[str, list[SliceRecord]] = {}
    for record in view.slices:
        held.setdefault(record.gpu, []).append(record)
    for gpu in view.gpus:
        slices = held.get(gpu.id, [])
        used = sum(record.used_bytes for record in slices)
        lines.append(phrases([
            Text(gpu.id, "bold"), Text(gpu.model), Text(format_bytes(gpu.memory_bytes)),
            Text(gpu.health, "green" if gpu.health == "Healthy" else "red"),
            Text(f"{len(slices)} of {gpu.replicas or 1} slice(s) held, {format_bytes(used)} in use"),
            Text(f"enforced by {gpu.enforced_by or 'none'}"),
        ], width))
    if not view.slices:
        lines.append(Text("no slice is held by a container (or slices are not enforced here)", style="dim"))
        return Group(*lines)
    columns = [Column("GPU"), Column("unit", 2), Column("held by"), Column("memory"), Column("used", 3, "right"),
               Column("budget", 3, "right"), Column("waited", 1, "right")]
    rows: list[Sequence[RenderableType]] = [
        [record.gpu or "-", record.unit or "-", _holder(record), bar(record.used_bytes, record.budget_bytes),
         format_bytes(record.used_bytes), format_bytes(record.budget_bytes) if record.budget_bytes else "-",
         f"{record.compute_wait_seconds:.1f}s"]
        for record in sorted(view.slices, key=lambda r: (r.gpu, r.unit))]
    table, dropped = fit(Console(width=width), columns, rows, width)
    lines.append(table)
    if dropped:
        lines.append(Text(f"(left out at this width: {', '.join(dropped)})", style="dim"))
    return Group(*lines)


async def watch(console: Console, url: str, interval: float) -> None:
    """Redraw every ``interval`` seconds until interrupted. Raises TopError when the first view cannot be had (a
    wrong address is said at once, not retried for ever); an endpoint that stops answering later is said, and
    asked again."""
    from rich.live import Live

    first: RenderableType = render(await fetch(url), console.width)
    with Live(first, console=console, auto_refresh=False, screen=False) as live:
        while True:
            await asyncio.sleep(interval)
            try:
                view: RenderableType = render(await fetch(url), console.width)
            except TopError as exc:
                view = Text(f"gpuppetti top: {exc}; trying again", style="red")
            live.update(view, refresh=True)
