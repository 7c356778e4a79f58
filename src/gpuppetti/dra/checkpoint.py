"""The DRA driver's record of prepared claims: versioned, checksummed, and written atomically.

A claim is recorded as PrepareStarted before any side effect and PrepareCompleted after its CDI spec is written,
so a crash in between is redone on the kubelet's retry. A corrupt file is reported loudly and moved aside: the
driver keeps serving rather than crash-looping, and the kubelet's retries prepare the claims again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from gpuppetti.fsutil import atomic_write

log = logging.getLogger(__name__)

VERSION = "v1"
State = Literal["PrepareStarted", "PrepareCompleted"]
STARTED: Final = "PrepareStarted"
COMPLETED: Final = "PrepareCompleted"


@dataclass
class PreparedDevice:
    request_names: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None


@dataclass
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    state: State
    devices: list[PreparedDevice] = field(default_factory=list)
    cdi_spec: dict[str, Any] | None = None
    cdi_file: str | None = None


def _canonical(claims: dict[str, Any]) -> str:
    return json.dumps(claims, sort_keys=True, separators=(",", ":"))


def _checksum(claims: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(claims).encode()).hexdigest()


def _as_json(record: ClaimRecord) -> dict[str, Any]:
    # By hand rather than dataclasses.asdict, which deep-copies every CDI spec on every save.
    return {
        "uid": record.uid, "namespace": record.namespace, "name": record.name, "state": record.state,
        "devices": [vars(device) for device in record.devices],
        "cdi_spec": record.cdi_spec, "cdi_file": record.cdi_file,
    }


class CorruptCheckpoint(Exception):
    pass


def _decode(raw: bytes) -> dict[str, ClaimRecord]:
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise CorruptCheckpoint("not a JSON object")
    if document.get("version") != VERSION:
        raise CorruptCheckpoint(f"unknown version {document.get('version')!r} (expected {VERSION})")
    claims = document.get("claims")
    if not isinstance(claims, dict):
        raise CorruptCheckpoint("no claims object")
    if document.get("checksum") != _checksum(claims):
        raise CorruptCheckpoint("checksum mismatch")
    records: dict[str, ClaimRecord] = {}
    try:
        for uid, raw_record in claims.items():
            devices = [PreparedDevice(**device) for device in raw_record.pop("devices", [])]
            records[uid] = ClaimRecord(devices=devices, **raw_record)
    except TypeError as exc:
        raise CorruptCheckpoint(f"unexpected record shape: {exc}") from exc
    return records


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.claims: dict[str, ClaimRecord] = {}

    def load(self) -> str | None:
        """Read the file. Returns where a corrupt file was moved, after logging why; None otherwise."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self.claims = {}
            return None
        try:
            self.claims = _decode(raw)
            return None
        except CorruptCheckpoint as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}")
            self.path.replace(aside)
            log.error("checkpoint %s is corrupt (%s); moved it to %s and started empty. Claims it held will be "
                      "prepared again when the kubelet retries them", self.path, exc, aside)
            self.claims = {}
            return str(aside)

    def save(self) -> None:
        canonical = _canonical({uid: _as_json(record) for uid, record in self.claims.items()})
        checksum = hashlib.sha256(canonical.encode()).hexdigest()
        # The claims are serialised once, for the checksum and the file alike.
        document = f'{{"version":"{VERSION}","checksum":"{checksum}","claims":{canonical}}}\n'
        atomic_write(self.path, document.encode(), mode=0o600)
