"""How ``gpuppetti install`` and ``gpuppetti uninstall`` stop when they cannot go on: one line, and whose it is."""

from __future__ import annotations


class InstallError(Exception):
    """Why the command cannot go on, in one line; ``bad_input``: the user can fix it (exit 2), else exit 1."""

    def __init__(self, message: str, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input
