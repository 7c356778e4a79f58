"""The host agent's bearer token: generated once, kept with mode 0600 in the user's config directory."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

import platformdirs

TOKEN_FILE = "host-agent.token"
SECRET_NAME = "gpuppetti-host-agent"


def default_token_path() -> Path:
    return Path(platformdirs.user_config_dir("gpuppetti")) / TOKEN_FILE


def load_or_create(path: Path) -> tuple[str, bool]:
    """The token at ``path``, creating it (mode 0600) if there is none. Returns (token, created)."""
    try:
        token = path.read_text(encoding="utf-8").strip()
        if token:
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
            return token, False
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    token = secrets.token_urlsafe(32)
    # O_EXCL: never overwrite a token another agent wrote a moment ago.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(token + "\n")
    return token, True


def matches(expected: str, header: str | None) -> bool:
    """Whether an Authorization header carries ``expected``, compared in constant time."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), expected.encode())


def secret_command(token: str, namespace: str = "gpuppetti") -> str:
    return (f"kubectl create secret generic {SECRET_NAME} --namespace {namespace} "
            f"--from-literal=token={token}")
