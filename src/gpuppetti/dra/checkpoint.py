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
import itertools
import json
import logging
import os
import shutil
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal

from gpuppetti.base.fsutil import atomic_write

log = logging.getLogger(__name__)

VERSION = "v1"
State = Literal["PrepareStarted", "PrepareCompleted"]
STARTED: Final = "PrepareStarted"
COMPLETED: Final = "PrepareCompleted"


# Slots: a driver holds a record per prepared claim, and a node may hold a thousand.
@dataclass(frozen=True, slots=True)
class PreparedDevice:
    request_names: list[str]
    pool: str
    device: str
    cdi_device_ids: list[str]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    state: State
    devices: list[PreparedDevice] = field(default_factory=list)
    # The claim's CDI spec as its file holds it (canonical JSON, cdi.encode_spec, less the newline): the record's
    # entry in the file and the spec's file are written from these bytes, never from a dict kept beside them. In
    # the file it is a JSON object.
    cdi_spec: bytes | None = None
    cdi_file: str | None = None
    # The Vulkan layer's directory of each request held to a slice, with each GPU's memory budget: recorded with
    # the plan, before the directories exist, so that restore and unprepare know exactly which are the claim's.
    layer_allocations: dict[str, list[int]] = field(default_factory=dict)


# Made once: json.dumps with options builds an encoder on every call, and a save encodes each new record. Records
# are trees of plain values, so there is no cycle to look for.
_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)


def _canonical(claims: Any) -> str:
    return _ENCODER.encode(claims)


def _checksum(claims: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical(claims).encode()).hexdigest()


def _device_json(device: PreparedDevice) -> dict[str, Any]:
    return {"request_names": device.request_names, "pool": device.pool, "device": device.device,
            "cdi_device_ids": device.cdi_device_ids, "share_id": device.share_id}


def _entry(key: str, record: ClaimRecord) -> tuple[bytes, ...]:
    """The record's entry in the claims object as ``_canonical`` writes it: its quoted uid ``key``, a colon and its
    canonical JSON, in pieces. The CDI spec's piece is the record's own bytes, shared rather than copied."""
    # By hand rather than dataclasses.asdict, which deep-copies; the spec is spliced in, not encoded again.
    body = {"uid": record.uid, "namespace": record.namespace, "name": record.name, "state": record.state,
            "devices": [_device_json(device) for device in record.devices], "cdi_file": record.cdi_file,
            "layer_allocations": record.layer_allocations}
    if record.cdi_spec is None:
        return (f"{key}:{_canonical({**body, 'cdi_spec': None})}".encode(),)
    text = _canonical(body)
    # Keys sorted, cdi_spec goes between cdi_file and devices; nothing before that point can read ',"devices":',
    # since a quote inside a JSON string is escaped.
    cut = text.index(',"devices":')
    return f'{key}:{text[:cut]},"cdi_spec":'.encode(), record.cdi_spec, text[cut:].encode()


class CorruptCheckpoint(Exception):
    pass


class UnusableCheckpoint(Exception):
    """The checkpoint path cannot be used at all; the message says what to do."""


def _known(kind: type, raw: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(kind)}
    return {key: value for key, value in raw.items() if key in names}


def _is_strings(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


# Each field's check: a checksum proves the file is whole, not that what wrote it was right.
_DEVICE_FIELDS: dict[str, Any] = {
    "request_names": _is_strings, "pool": lambda v: isinstance(v, str), "device": lambda v: isinstance(v, str),
    "cdi_device_ids": _is_strings, "share_id": lambda v: v is None or isinstance(v, str),
}
_CLAIM_FIELDS: dict[str, Any] = {
    "uid": lambda v: isinstance(v, str), "namespace": lambda v: isinstance(v, str),
    "name": lambda v: isinstance(v, str), "state": lambda v: v in (STARTED, COMPLETED),
    "devices": lambda v: isinstance(v, list), "cdi_spec": lambda v: v is None or isinstance(v, dict),
    "cdi_file": lambda v: v is None or isinstance(v, str),
    "layer_allocations": lambda v: isinstance(v, dict) and all(
        isinstance(memories, list) and all(isinstance(m, int) and not isinstance(m, bool) for m in memories)
        for memories in v.values()),
}


def _checked(where: str, raw: object, checks: dict[str, Any], kind: type, lenient: bool) -> dict[str, Any]:
    """raw's fields for kind, each of the right type; raises CorruptCheckpoint naming what is wrong."""
    if not isinstance(raw, dict):
        raise CorruptCheckpoint(f"{where}: not an object")
    fields = _known(kind, raw) if lenient else dict(raw)
    required = {f.name for f in dataclasses.fields(kind)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    unknown = sorted(set(fields) - set(checks))
    missing = sorted(required - set(fields))
    if unknown or missing:
        raise CorruptCheckpoint(f"{where}: unknown fields {unknown}, missing fields {missing}")
    for name, value in fields.items():
        if not checks[name](value):
            raise CorruptCheckpoint(f"{where}: {name} is {type(value).__name__} {str(value)[:60]!r}")
    return fields


def _records(claims: dict[str, Any], lenient: bool) -> dict[str, ClaimRecord]:
    records: dict[str, ClaimRecord] = {}
    for uid, raw in claims.items():
        fields = _checked(f"claim {uid}", raw, _CLAIM_FIELDS, ClaimRecord, lenient)
        devices = [PreparedDevice(**_checked(f"claim {uid}: device {index}", device, _DEVICE_FIELDS,
                                             PreparedDevice, lenient))
                   for index, device in enumerate(fields.pop("devices", []))]
        spec = fields.pop("cdi_spec", None)
        records[uid] = ClaimRecord(devices=devices, cdi_spec=None if spec is None else _canonical(spec).encode(),
                                   **fields)
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
        # Each saved record, by uid, with its quoted uid and its entry in the canonical claims object (_entry):
        # records are never changed, only replaced, so a save encodes only new ones.
        self._entries: dict[str, tuple[ClaimRecord, str, tuple[bytes, ...]]] = {}

    @property
    def claims(self) -> Mapping[str, ClaimRecord]:
        """What the file says now."""
        return self._claims

    def load(self) -> str | None:
        """Read the file. Returns where a corrupt (or newer) file's copy was put, after logging why; None otherwise.
        Raises UnusableCheckpoint when the path cannot hold a checkpoint at all."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self._entries = {}
        try:
            if self.path.is_dir():
                raise CorruptCheckpoint("a directory, not a file")
            raw = self.path.read_bytes()
            records, version = decode(raw)
        except FileNotFoundError:
            self._claims = MappingProxyType({})
            return None
        except CorruptCheckpoint as exc:
            aside = self.path.with_name(f"{self.path.name}.corrupt-{stamp}")
            try:
                os.rename(self.path, aside)
            except OSError as error:
                raise UnusableCheckpoint(f"the checkpoint {self.path} is corrupt ({exc}) and cannot be moved aside: "
                                         f"{error.strerror or error}; move it away and start the driver again") \
                    from error
            log.error("checkpoint %s is corrupt (%s); moved it to %s and started empty. Claims it held will be "
                      "prepared again when the kubelet retries them", self.path, exc, aside)
            self._claims = MappingProxyType({})
            return str(aside)
        except OSError as exc:
            raise UnusableCheckpoint(f"cannot read the checkpoint {self.path}: {exc.strerror or exc}") from exc
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
        entries: dict[str, tuple[ClaimRecord, str, tuple[bytes, ...]]] = {}
        previous = self._entries
        for uid in sorted(claims):
            record = claims[uid]
            cached = previous.get(uid)
            if cached is not None and cached[0] is record:
                entries[uid] = cached
                continue
            key = cached[1] if cached is not None else _ENCODER.encode(uid)
            entries[uid] = (record, key, _entry(key, record))

        def claims_object() -> Iterator[bytes]:
            # As _canonical writes the claims (keys sorted, compact), from the records' entries, a piece at a time:
            # a thousand claims are never held again as one document.
            yield b"{"
            for number, (_, _, entry) in enumerate(entries.values()):
                if number:
                    yield b","
                yield from entry
            yield b"}"

        digest = hashlib.sha256()
        for piece in claims_object():
            digest.update(piece)
        header = f'{{"version":"{VERSION}","checksum":"{digest.hexdigest()}","claims":'.encode()
        atomic_write(self.path, itertools.chain([header], claims_object(), [b"}\n"]), mode=0o600)
        self._claims = MappingProxyType(dict(claims))
        self._entries = entries
