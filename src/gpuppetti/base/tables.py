"""Tables that fit the width they are printed at, without cutting a value short.

An id, a device path or an env value cut to ``sim…`` is worse than none. So a table that is too wide first loses
its columns that say nothing (every cell empty), then its least important ones, and what still does not fit is
folded onto more lines, never ellipsised. The caller is told which columns were left out, to say so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console, ConsoleOptions, RenderableType
from rich.table import Table
from rich.text import Text

EMPTY = ("", "-")
UNBOUNDED = 100_000


@dataclass(frozen=True)
class Column:
    header: str
    # Columns with the lowest rank go first when the table is too wide; 0 never goes.
    rank: int = 0
    justify: str = "left"


def fit(console: Console, columns: Sequence[Column], rows: Sequence[Sequence[RenderableType]],
        width: int | None = None) -> tuple[Table, list[str]]:
    """The table at ``width`` (the console's by default), and the headers of the columns left out.

    The columns that must stay are taken first, then the others from the most important down, each one that
    still fits; a column that says nothing (every cell empty) is left out unmentioned.
    """
    width = width or console.width
    # Measured without a limit: a measurement is clamped to the width it is given, which would hide the excess.
    unbounded = console.options.update_width(UNBOUNDED)
    natural = [_natural_width(console, unbounded, column.header, [row[i] for row in rows])
               for i, column in enumerate(columns)]
    telling = [i for i, column in enumerate(columns)
               if column.rank == 0 or any(not _empty(row[i]) for row in rows)]
    keep = [i for i in telling if columns[i].rank == 0]
    dropped: list[str] = []
    for i in sorted((i for i in telling if columns[i].rank > 0), key=lambda i: (-columns[i].rank, i)):
        # A box's lines and a space either side of each column.
        if sum(natural[j] for j in [*keep, i]) + 3 * (len(keep) + 1) + 1 <= width:
            keep.append(i)
        else:
            dropped.append(columns[i].header)
    return _table(columns, rows, sorted(keep), natural), dropped


class Prose(Text):
    """A cell of words, which may wrap: up to PROSE_WIDTH of it (or its longest word) counts towards the table's
    width, not all of it."""


# Wider than most GPU models, so that a model's name wraps only where the width is short of it.
PROSE_WIDTH = 16


def _natural_width(console: Console, options: ConsoleOptions, header: str,
                   cells: Sequence[RenderableType]) -> int:
    widths = [len(header)]
    for cell in cells:
        measured = console.measure(_as_text(cell), options=options)
        if isinstance(cell, Prose):
            widths.append(min(measured.maximum, max(measured.minimum, PROSE_WIDTH)))
        else:
            widths.append(measured.maximum)
    return max(widths)


def _as_text(cell: RenderableType) -> RenderableType:
    # Plain strings as text, never as markup: a value with "[...]" in it must print as it is.
    if isinstance(cell, str):
        return Text(cell)
    return cell


def _empty(cell: RenderableType) -> bool:
    text = cell.plain if isinstance(cell, Text) else cell
    return isinstance(text, str) and text.strip() in EMPTY


def _table(columns: Sequence[Column], rows: Sequence[Sequence[RenderableType]], keep: list[int],
           natural: list[int]) -> Table:
    table = Table(show_lines=False, pad_edge=True)
    for i in keep:
        # A column of values keeps its full width, so that only prose wraps while the table fits.
        values = not any(isinstance(row[i], Prose) for row in rows)
        table.add_column(columns[i].header, overflow="fold", justify=columns[i].justify,  # type: ignore[arg-type]
                         width=natural[i] if values else None)
    for row in rows:
        table.add_row(*(_as_text(row[i]) for i in keep))
    return table


def print_trimmed(console: Console, renderable: RenderableType) -> None:
    """Print without the spaces rich pads a grid's last column with: output that is pasted or diffed should
    carry no trailing blanks."""
    with console.capture() as capture:
        console.print(renderable)
    console.file.write("".join(line.rstrip() + "\n" for line in capture.get().splitlines()))


def print_table(console: Console, title: str, columns: Sequence[Column],
                rows: Sequence[Sequence[RenderableType]]) -> None:
    """A bold title on its own line (a table's title would be padded to the table's width), the table, and a
    line naming the columns this width left out."""
    table, dropped = fit(console, columns, rows)
    console.print(Text(title, style="bold"))
    console.print(table)
    if dropped:
        print_trimmed(console, Text(f"(left out at this width: {', '.join(dropped)})", style="dim"))
