"""The DRA driver's record of prepared claims: versioned, checksummed, and written atomically and durably.

A claim is recorded as PrepareStarted before any side effect and PrepareCompleted after its CDI spec is written,
so a crash in between is redone on the kubelet's retry. ``claims`` is always what the file says: a new state is
saved first and taken only once the save succeeded, so a failed save (a full disk) leaves memory, the file and
what the kubelet was told in agreement.

A corrupt file is reported loudly and moved aside: the driver keeps serving rather than crash-looping, and the
kubelet's retries prepare the claims again. A file written by a newer version is read for what this version knows,
and a copy of it is kept beside it, so a downgrade keeps its prepared claims and loses nothing silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal

from gpuppetti.fsutil import atomic_write

log = logging.getLogger(__name__)

VERSION = "v1"
State = Literal["PrepareStarted", "PrepareCompleted"]
STARTED: Final = "PrepareStarted"
COMPLETED: Final = "PrepareCompleted"


@dataclass(frozen=True)
class PreparedDevice:
    request_names: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None


@dataclass(frozen=True)
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


class UnusableCheckpoint(Exception):
    """The checkpoint path cannot be used at all; the message says what to do."""


def _known(kind: type, raw: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(kind)}
    return {key: value for key, value in raw.items() if key in names}


def _records(claims: dict[str, Any], lenient: bool) -> dict[str, ClaimRecord]:
    records: dict[str, ClaimRecord] = {}
    try:
        for uid, raw in claims.items():
            raw = dict(raw)
            devices = [PreparedDevice(**(_known(PreparedDevice, d) if lenient else d)) for d in raw.pop("devices", [])]
            fields = _known(ClaimRecord, raw) if lenient else raw
            record = ClaimRecord(devices=devices, **fields)
            if record.state not in (STARTED, COMPLETED):
                raise CorruptCheckpoint(f"claim {uid}: unknown state {record.state!r}")
            records[uid] = record
    except (TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(f"unexpected record shape: {exc}") from exc
    return records


def decode(raw: bytes) -> tuple[dict[str, ClaimRecord], str]:
    """The records in ``raw`` and the version that wrote them. Raises CorruptCheckpoint."""
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpoint(f"not JSON: {exc}") from exc
    if not isinstance(document, dict):
        raise CorruptCheckpoint("not a JSON object")
    version = document.get("version")
    claims = document.get("claims")
    if not isinstance(version, str) or not version:
        raise CorruptCheckpoint("no version")
    if not isinstance(claims, dict):
        raise CorruptCheckpoint("no claims object")
    if version == VERSION:
        if document.get("checksum") != _checksum(claims):
            raise CorruptCheckpoint("checksum mismatch")
        return _records(claims, lenient=False), version
    # A newer version may add fields (and checksum them its own way): take what this version knows.
    return _records(claims, lenient=True), version


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._claims: Mapping[str, ClaimRecord] = MappingProxyType({})

    @property
    def claims(self) -> Mapping[str, ClaimRecord]:
        """What the file says now."""
        return self._claims

    def load(self) -> str | None:
        """Read the file. Returns where a corrupt (or newer) file's copy was put, after logging why; None otherwise.
        Raises UnusableCheckpoint when the path cannot hold a checkpoint at all."""
        if self.path.is_dir():
            raise UnusableCheckpoint(
                f"the checkpoint path {self.path} is a directory, not a file: remove it (or move it away) and "
                "start the driver again")
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            self._claims = MappingProxyType({})
            return None
        except OSError as exc:
            raise UnusableCheckpoint(f"cannot read the checkpoint {self.path}: {exc.strerror or exc}") from exc
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        try:
            records, version = decode(raw)
        except CorruptCheckpoint as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            self.path.replace(aside)
            log.error("checkpoint %s is corrupt (%s); moved it to %s and started empty. Claims it held will be "
                      "prepared again when the kubelet retries them", self.path, exc, aside)
            self._claims = MappingProxyType({})
            return str(aside)
        self._claims = MappingProxyType(records)
        if version == VERSION:
            return None
        # The next save writes this version's format; keep the newer one's file whole beside it.
        copy = self.path.with_name(f"{self.path.name}.{version}-{stamp}")
        shutil.copy2(self.path, copy)
        log.warning("checkpoint %s was written by a newer gpuppetti (format %s; this one writes %s): read the %d "
                    "claim(s) it holds as far as this version understands them, and kept the file as %s",
                    self.path, version, VERSION, len(records), copy)
        return str(copy)

    def save(self, claims: Mapping[str, ClaimRecord]) -> None:
        """Write ``claims`` durably, then take them as the current state. Blocks (fsync): call it in a thread.
        Raises OSError, and keeps the previous state, when the write fails."""
        canonical = _canonical({uid: _as_json(record) for uid, record in claims.items()})
        checksum = hashlib.sha256(canonical.encode()).hexdigest()
        # The claims are serialised once, for the checksum and the file alike.
        document = f'{{"version":"{VERSION}","checksum":"{checksum}","claims":{canonical}}}\n'
        atomic_write(self.path, document.encode(), mode=0o600)
        self._claims = MappingProxyType(dict(claims))
