"""One line of the checklist: what was checked, how it went, what was found, and the fix when it failed."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Status(enum.StrEnum):
    OK = "ok"
    # Works, but a feature will not: enforced slices without Vulkan, a sharing entry that does nothing.
    WARN = "warn"
    FAIL = "fail"
    # Nothing to check: no host agent configured, no daemon address given.
    SKIP = "skip"


MARKS = {Status.OK: "✔", Status.WARN: "!", Status.FAIL: "✖", Status.SKIP: "-"}


@dataclass(frozen=True)
class Result:
    check: str
    status: Status
    detail: str
    fix: str | None = None

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL

    def record(self) -> dict[str, Any]:
        return {"check": self.check, "status": self.status.value, "detail": self.detail, "fix": self.fix}


def ok(check: str, detail: str) -> Result:
    return Result(check, Status.OK, detail)


def warn(check: str, detail: str, fix: str | None = None) -> Result:
    return Result(check, Status.WARN, detail, fix)


def fail(check: str, detail: str, fix: str) -> Result:
    return Result(check, Status.FAIL, detail, fix)


def skip(check: str, detail: str) -> Result:
    return Result(check, Status.SKIP, detail)
