"""The host agent's bearer token: generated once, kept with mode 0600 in the user's config directory."""

from __future__ import annotations

import hmac
import os
import secrets
import shlex
from pathlib import Path

import platformdirs

TOKEN_FILE = "host-agent.token"
SECRET_NAME = "gpuppetti-host-agent"


def default_token_path() -> Path:
    return Path(platformdirs.user_config_dir("gpuppetti")) / TOKEN_FILE


class TokenFileError(Exception):
    """The token file cannot be used; the message starts with its path."""


def load_or_create(path: Path) -> tuple[str, bool]:
    """The token at ``path``, creating it (mode 0600) if there is none. Returns (token, created).

    An existing file that holds no token is an error, not something to overwrite: the cluster's Secret may have
    been made from it, and a new token would lock the plugin out without a word.
    """
    try:
        token = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return _create(path), True
    except IsADirectoryError:
        raise TokenFileError(f"{path}: is a directory; give the path of a file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenFileError(f"{path}: cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    if not token:
        raise TokenFileError(f"{path}: is empty; remove it to have a new token made, or write the token in it")
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return token, False


def _create(path: Path) -> str:
    token = secrets.token_urlsafe(32)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        # O_EXCL: never overwrite a token another agent wrote a moment ago.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise TokenFileError(f"{path}: cannot be created: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(token + "\n")
    return token


def matches(expected: str, header: str | None) -> bool:
    """Whether an Authorization header carries ``expected``, compared in constant time."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), expected.encode())


def secret_command(path: Path, namespace: str = "gpuppetti") -> str:
    """The kubectl command that puts the token in the cluster. It reads the file: the token itself is never
    printed, so it lands in no log and no shell history."""
    return (f"kubectl create secret generic {SECRET_NAME} --namespace {namespace} "
            f"--from-file=token={shlex.quote(str(path))}")
