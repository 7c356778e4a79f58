"""The DRA driver's record of prepared claims: versioned, checksummed, and written atomically and durably.

A claim is recorded as PrepareStarted before any side effect and PrepareCompleted after its CDI spec is written,
so a crash in between is redone on the kubelet's retry. ``claims`` is always what the file says: a new state is
saved first and taken only once the save succeeded, so a failed save (a full disk) leaves memory, the file and
what the kubelet was told in agreement.

The document and its records are msgspec types, encoded and decoded whole: their types say what a valid file holds
(a checksum proves the file is whole, not that what wrote it was right), and the checksum is over the claims'
canonical encoding (keys sorted at every level), so the order of the fields in a file is no part of it. A file
whose checksum the first v1 writers computed their own way is taken as theirs (a migration on load); the next save
writes it anew.

A corrupt file is reported loudly and moved aside: the driver keeps serving rather than crash-looping, and the
kubelet's retries prepare the claims again. A file written by a newer version is read for what this version knows,
and a copy of it is kept beside it, so a downgrade keeps its prepared claims and loses nothing silently.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, Final, Literal

import msgspec

from gpuppetti.base.fsutil import atomic_write
from gpuppetti.core import cdi
from gpuppetti.kit.draplugin import PreparedDevice

log = logging.getLogger(__name__)

VERSION = "v1"
State = Literal["PrepareStarted", "PrepareCompleted"]
STARTED: Final = "PrepareStarted"
COMPLETED: Final = "PrepareCompleted"

# A path component the checkpoint names (a CDI spec's file, a layer directory, a claim's uid): a plain name, never a
# way out of its directory.
Component = Annotated[str, msgspec.Meta(pattern=r"^(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")]


class SpecJson(bytes):
    """A claim's CDI spec as its file holds it (canonical JSON, cdi.encode_spec, less the newline): the record's entry
    in the checkpoint and the spec's file are written from these bytes, never from a dict kept beside them. In the
    checkpoint it is the JSON object it is, inserted as it is."""

    # No instance dict: one is held per prepared claim.
    __slots__ = ()


def spec_json(spec: str) -> bytes:
    """A claim's CDI spec (cdi.encode_spec's text) as its record holds it: encoded straight into SpecJson, since a
    record given plain bytes holds a copy, and a thousand-claim Prepare would leave the thousand freed originals
    scattered among the records it keeps."""
    return SpecJson(spec, "utf-8")


if TYPE_CHECKING:
    # What callers give and get: the spec's bytes (a record made from plain bytes holds them as SpecJson).
    _Spec = bytes
else:
    _Spec = SpecJson


# Untracked by the cyclic collector (gc=False), which saves each record its header and the collector a thousand
# objects to scan: a record holds strings, numbers and containers of them, never itself.
class ClaimRecord(msgspec.Struct, frozen=True, forbid_unknown_fields=True, gc=False):
    uid: Component
    namespace: str
    name: str
    state: State
    devices: list[PreparedDevice] = msgspec.field(default_factory=list)
    cdi_spec: _Spec | None = None
    cdi_file: Component | None = None
    # The Vulkan layer's directory of each request held to a slice, with each GPU's memory budget: recorded with
    # the plan, before the directories exist, so that restore and unprepare know exactly which are the claim's.
    layer_allocations: dict[Component, list[int]] = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Plain bytes would be written as base64: held as SpecJson, they are written as the object they are.
        if type(self.cdi_spec) is bytes:
            msgspec.structs.force_setattr(self, "cdi_spec", SpecJson(self.cdi_spec))


class Document(msgspec.Struct, kw_only=True):
    """The file: ``claims`` is the claims' canonical encoding, which ``checksum`` (a SHA-256, in hex) is over."""

    version: Annotated[str, msgspec.Meta(min_length=1)]
    # A newer version may checksum its own way, with a value of its own kind.
    checksum: Any = None
    claims: msgspec.Raw


# The largest legitimate checkpoint, with room: 10,000 claims of four GPUs each, with the layer's mounts in their
# specs, stay well within it (test_checkpoint). A larger file is not read: it is moved aside as a corrupt one is,
# since reading it whole could take the driver past its container's memory limit before it could do so, and again
# at every start.
MAX_BYTES = 32 << 20


def _encode_hook(value: object) -> msgspec.Raw:
    if isinstance(value, SpecJson):
        return msgspec.Raw(value)
    raise NotImplementedError(f"cannot encode {type(value).__name__}")


def _decode_hook(kind: type, value: object) -> object:
    if kind is SpecJson:
        if not isinstance(value, dict):
            raise ValueError("a CDI spec must be an object")
        # Canonical whatever the file's order of keys: the spec's file is written from these bytes.
        return spec_json(cdi.encode_spec(value))
    raise NotImplementedError(f"cannot decode {kind.__name__}")


# Object keys and fields sorted at every level: the canonical encoding the checksum is over.
_CLAIMS_ENCODER = msgspec.json.Encoder(enc_hook=_encode_hook, order="sorted")
# The document's fields in their own order (version, checksum, claims), as every writer has written them.
_DOCUMENT_ENCODER = msgspec.json.Encoder()


def _checksum(encoded: bytes) -> str:
    return hashlib.sha256(encoded).hexdigest()


def encode(claims: Mapping[str, ClaimRecord]) -> bytes:
    """The checkpoint file's document for ``claims`` (without the newline that ends the file)."""
    encoded = _CLAIMS_ENCODER.encode(claims if isinstance(claims, dict) else dict(claims))
    return _DOCUMENT_ENCODER.encode(Document(version=VERSION, checksum=_checksum(encoded),
                                             claims=msgspec.Raw(encoded)))


# The checksum as the first v1 writers computed it, over the standard library's encoding of the claims they read
# (which escapes what is not ASCII): a file of theirs whose records hold such text still verifies.
_LEGACY = json.JSONEncoder(sort_keys=True, separators=(",", ":"), check_circular=False)


def _legacy_checksum(claims: Any) -> str:
    return hashlib.sha256(_LEGACY.encode(claims).encode()).hexdigest()


class CorruptCheckpoint(Exception):
    pass


class UnusableCheckpoint(Exception):
    """The checkpoint path cannot be used at all; the message says what to do."""


def _records(claims: msgspec.Raw | object) -> dict[str, ClaimRecord]:
    """The claims as records, each checked by its type. Raises msgspec.ValidationError, CorruptCheckpoint."""
    # ClaimRecord is looked up at each call, not bound into a decoder once: a test stands a later version's record in.
    if isinstance(claims, msgspec.Raw):
        records = msgspec.json.decode(claims, type=dict[str, ClaimRecord], dec_hook=_decode_hook)
    else:
        records = msgspec.convert(claims, dict[str, ClaimRecord], dec_hook=_decode_hook)
    for uid, record in records.items():
        if record.uid != uid:
            raise CorruptCheckpoint(f"claim {uid[:80]!r}: its record names uid {record.uid[:80]!r}")
    return records


def _known_fields(claims: object) -> object:
    """A newer version's claims, less the fields this version's records do not have."""
    if not isinstance(claims, dict):
        return claims
    fields, device_fields = set(ClaimRecord.__struct_fields__), set(PreparedDevice.__struct_fields__)

    def known(raw: object, names: set[str]) -> object:
        return {key: value for key, value in raw.items() if key in names} if isinstance(raw, dict) else raw

    known_claims: dict[object, object] = {}
    for uid, raw in claims.items():
        record = known(raw, fields)
        if isinstance(record, dict) and isinstance(record.get("devices"), list):
            record["devices"] = [known(device, device_fields) for device in record["devices"]]
        known_claims[uid] = record
    return known_claims


def decode(raw: bytes) -> tuple[dict[str, ClaimRecord], str]:
    """The records in ``raw`` and the version that wrote them. Raises CorruptCheckpoint."""
    try:
        document = msgspec.json.decode(raw, type=Document)
        if document.version != VERSION:
            # A newer version may add fields (and checksum them its own way): take what this version knows.
            return _records(_known_fields(msgspec.json.decode(document.claims))), document.version
        records = _records(document.claims)
    except msgspec.DecodeError as exc:
        raise CorruptCheckpoint(str(exc)) from exc
    # Over the data read, not the file's bytes: the order of its fields is no part of it.
    if document.checksum != _checksum(_CLAIMS_ENCODER.encode(records)) and \
            document.checksum != _legacy_checksum(msgspec.json.decode(document.claims)):
        raise CorruptCheckpoint("checksum mismatch")
    return records, document.version


def _read(path: Path) -> tuple[bytes, tuple[int, int, int]]:
    """The file's bytes, if it is a regular file no larger than MAX_BYTES, and the identity of what was read (its
    inode, modification time and size). Raises CorruptCheckpoint, OSError."""
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
    return raw, (st.st_ino, st.st_mtime_ns, st.st_size)


class Checkpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._claims: Mapping[str, ClaimRecord] = MappingProxyType({})
        # The file as this process last read or wrote it: another instance's save changes it (refresh).
        self._seen: tuple[int, int, int] | None = None

    def _identity(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return st.st_ino, st.st_mtime_ns, st.st_size

    def refresh(self) -> None:
        """Read the file again if another process wrote it since this one last read or wrote it (the other
        instance of a rolling update; the caller holds the lock both take). Blocks: call it in a thread. Raises
        UnusableCheckpoint as ``load``."""
        if self._identity() != self._seen:
            self.load()

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
                raw, seen = _read(self.path)
            except IsADirectoryError as exc:
                raise CorruptCheckpoint("a directory, not a file") from exc
            records, version = decode(raw)
            del raw
        except FileNotFoundError:
            self._claims = MappingProxyType({})
            self._seen = None
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
            self._seen = None
            return str(aside)
        except OSError as exc:
            raise UnusableCheckpoint(f"cannot read the checkpoint {self.path}: {exc.strerror or exc}") from exc
        self._claims = MappingProxyType(records)
        self._seen = seen
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
        atomic_write(self.path, (encode(claims), b"\n"), mode=0o600)
        self._claims = MappingProxyType(dict(claims))
        self._seen = self._identity()
