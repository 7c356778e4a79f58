"""A benchmark's figure, as the table and the JSON file give it: shared by bench/run.py and the steps in modules of
their own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Figure:
    name: str
    value: float | None
    unit: str
    goal: str = "report"
    met: bool | None = None
    detail: str = ""
