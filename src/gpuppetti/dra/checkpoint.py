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
import re
import shutil
import stat
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Final, Literal

import msgspec

from gpuppetti.base.fsutil import atomic_write
from gpuppetti.core import cdi
from gpuppetti.kit.draplugin import PreparedDevice

log = logging.getLogger(__name__)

VERSION = "v1"
State = Literal["PrepareStarted", "PrepareCompleted"]
STARTED: Final = "PrepareStarted"
COMPLETED: Final = "PrepareCompleted"


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


# The largest legitimate checkpoint, with room: 10,000 claims of four GPUs each, with the layer's mounts in their
# specs, take 17.5 MB (test_checkpoint); a one-GPU claim takes 0.9 KB. A larger file is not read: it is moved aside
# as a corrupt one is, since reading it whole could take the driver past its container's memory limit (192 MiB)
# before it could do so, and again at every start.
MAX_BYTES = 32 << 20

# A path component the checkpoint names (a CDI spec's file, a layer directory): a plain name, never a way out of
# its directory.
_COMPONENT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}")


def _is_component(value: object) -> bool:
    return isinstance(value, str) and _COMPONENT.fullmatch(value) is not None and ".." not in value


_FIELD_NAMES: dict[type, tuple[str, ...]] = {}


def _field_names(kind: type) -> tuple[str, ...]:
    # Once per type: a save of a thousand claims asks a thousand times, and dataclasses.fields builds it anew.
    names = _FIELD_NAMES.get(kind)
    if names is None:
        names = _FIELD_NAMES[kind] = tuple(f.name for f in dataclasses.fields(kind))
    return names


def _body(record: ClaimRecord) -> dict[str, Any]:
    """The record as its entry in the file holds it: every field of its type, by name (a field added later is
    written and checksummed with the others), the CDI spec as the JSON object its bytes are, neither copied nor
    encoded again."""
    body = {name: getattr(record, name) for name in _field_names(type(record))}
    spec = body.get("cdi_spec")
    body["cdi_spec"] = None if spec is None else msgspec.Raw(spec)
    return body


# Object keys sorted at every level, whatever the order of the fields: the canonical encoding the checksum is over.
_ENCODER = msgspec.json.Encoder(order="sorted")


def _pieces(claims: Mapping[str, ClaimRecord]) -> Iterator[bytes]:
    """The claims object in its canonical encoding, a record at a time: a thousand claims are never held again as
    one document."""
    yield b"{"
    for number, uid in enumerate(sorted(claims)):
        yield (b"," if number else b"") + _ENCODER.encode(uid) + b":"
        yield _ENCODER.encode(_body(claims[uid]))
    yield b"}"


def _checksum(pieces: Iterable[bytes]) -> str:
    """Over the claims' canonical encoding, as _pieces gives it."""
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.hexdigest()


# The checksum as the first v1 writers computed it, over the standard library's encoding of the claims they read
# (which escapes what is not ASCII): a file of theirs whose records hold such text still verifies.
_LEGACY = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)


def _legacy_checksum(claims: Any) -> str:
    return hashlib.sha256(_LEGACY.encode(claims).encode()).hexdigest()


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
    "uid": _is_component, "namespace": lambda v: isinstance(v, str),
    "name": lambda v: isinstance(v, str), "state": lambda v: v in (STARTED, COMPLETED),
    "devices": lambda v: isinstance(v, list), "cdi_spec": lambda v: v is None or isinstance(v, dict),
    "cdi_file": lambda v: v is None or _is_component(v),
    "layer_allocations": lambda v: isinstance(v, dict) and all(_is_component(key) for key in v) and all(
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
        fields = _checked(f"claim {str(uid)[:80]!r}", raw, _CLAIM_FIELDS, ClaimRecord, lenient)
        if fields["uid"] != uid:
            raise CorruptCheckpoint(f"claim {uid[:80]!r}: its record names uid {fields['uid'][:80]!r}")
        devices = [PreparedDevice(**_checked(f"claim {uid}: device {index}", device, _DEVICE_FIELDS,
                                             PreparedDevice, lenient))
                   for index, device in enumerate(fields.pop("devices", []))]
        spec = fields.pop("cdi_spec", None)
        records[uid] = ClaimRecord(devices=devices,
                                   cdi_spec=None if spec is None else cdi.encode_spec(spec).encode(), **fields)
    return records


def decode(raw: bytes) -> tuple[dict[str, ClaimRecord], str]:
    """The records in ``raw`` and the version that wrote them. Raises CorruptCheckpoint."""
    try:
        document = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
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
        records = _records(claims, lenient=False)
        # Over the data read, not the file's bytes: the order of its fields is no part of it.
        checksum = document.get("checksum")
        if checksum != _checksum(_pieces(records)) and checksum != _legacy_checksum(claims):
            raise CorruptCheckpoint("checksum mismatch")
        return records, version
    # A newer version may add fields (and checksum them its own way): take what this version knows.
    return _records(claims, lenient=True), version


def _read(path: Path) -> bytes:
    """The file's bytes, if it is a regular file no larger than MAX_BYTES. Raises CorruptCheckpoint, OSError."""
    with path.open("rb") as file:
        st = os.fstat(file.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise CorruptCheckpoint("a directory, not a file")
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpoint("not a regular file")
        if st.st_size > MAX_BYTES:
            raise CorruptCheckpoint(f"{st.st_size:,} bytes, over the {MAX_BYTES >> 20} MiB a checkpoint of 10,000 "
                                    "claims stays within")
        # Bounded even if it grows meanwhile.
        raw = file.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise CorruptCheckpoint(f"over the {MAX_BYTES >> 20} MiB a checkpoint of 10,000 claims stays within")
    return raw


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
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        try:
            try:
                raw = _read(self.path)
            except IsADirectoryError as exc:
                raise CorruptCheckpoint("a directory, not a file") from exc
            records, version = decode(raw)
            del raw
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
        # Encoded once, a record at a time, and the pieces held only until they are written (the checksum, over
        # them, comes first in the file): encoding them twice instead cost a thousand-claim Prepare, which saves
        # twice, about 10 ms of its 120 (make bench).
        pieces = list(_pieces(claims))
        header = f'{{"version":"{VERSION}","checksum":"{_checksum(pieces)}","claims":'.encode()
        atomic_write(self.path, itertools.chain([header], pieces, [b"}\n"]), mode=0o600)
        self._claims = MappingProxyType(dict(claims))
