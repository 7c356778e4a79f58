from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpuppetti.base import fsutil
from gpuppetti.core import cdi
from gpuppetti.dra import checkpoint as checkpoint_module
from gpuppetti.dra.checkpoint import (
    COMPLETED,
    STARTED,
    Checkpoint,
    ClaimRecord,
    UnusableCheckpoint,
    _legacy_checksum,
    decode,
    encode,
    spec_json,
)
from gpuppetti.kit.draplugin import PreparedDevice


def _saved(tmp_path: Path) -> Checkpoint:
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    checkpoint.save({"uid-1": ClaimRecord(
        "uid-1", "default", "claim", COMPLETED,
        [PreparedDevice(["gpu"], "node1", "gpu-apple-0", ["k/c=claim-uid-1-gpu"], "s1")],
        cdi.encode_spec({"cdiVersion": "0.3.0"}).encode(), "k-c_uid-1.json")})
    return checkpoint


def test_round_trip(tmp_path: Path) -> None:
    saved = _saved(tmp_path)
    loaded = Checkpoint(saved.path)
    assert loaded.load() is None
    assert loaded.claims == saved.claims
    assert oct(saved.path.stat().st_mode & 0o777) == "0o600"
    assert not list(tmp_path.glob(".checkpoint.json.*")), "no temporary file is left behind"


# Shapes a checksum cannot catch: written whole, by something that wrote the wrong thing.
SHAPES: dict[str, Callable[[dict[str, Any]], Any]] = {
    "shape": lambda claim: {**claim, "unexpected": 1},
    "a list": lambda claim: [],
    "pairs": lambda claim: ["abc"],
    "a number for a name": lambda claim: {**claim, "name": 7},
    "devices not a list": lambda claim: {**claim, "devices": 5},
    "a device that is a list": lambda claim: {**claim, "devices": [["gpu"]]},
    "a device missing its pool": lambda claim: {**claim, "devices": [{"request_names": ["gpu"], "device": "d",
                                                                      "cdi_device_ids": []}]},
    "an unknown state": lambda claim: {**claim, "state": "Prepared"},
}


@pytest.mark.parametrize("damage", ["truncate", "checksum", "binary", *SHAPES])
def test_damage_is_detected_and_moved_aside(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    path = _saved(tmp_path).path
    raw = path.read_text()
    if damage == "truncate":
        path.write_text(raw[: len(raw) // 2])
    elif damage == "checksum":
        path.write_text(raw.replace("gpu-apple-0", "gpu-apple-1"))
    elif damage in SHAPES:
        document = json.loads(raw)
        document["claims"]["uid-1"] = SHAPES[damage](document["claims"]["uid-1"])
        document["checksum"] = _legacy_checksum(document["claims"])
        path.write_text(json.dumps(document))
    else:
        path.write_bytes(b"\xff\xfe\x00garbage")
    checkpoint = Checkpoint(path)
    aside = checkpoint.load()
    assert aside is not None and Path(aside).exists()
    assert checkpoint.claims == {}
    assert not path.exists()
    assert "is corrupt" in caplog.text


def test_missing_file_is_empty(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "none.json")
    assert checkpoint.load() is None and checkpoint.claims == {}


def test_a_newer_version_is_read_for_what_this_one_knows_and_kept(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    saved = _saved(tmp_path)
    document = json.loads(saved.path.read_text())
    document["version"] = "v9"
    document["checksum"] = "computed differently"
    document["claims"]["uid-1"]["newField"] = {"x": 1}
    document["claims"]["uid-1"]["devices"][0]["alsoNew"] = True
    saved.path.write_text(json.dumps(document))
    checkpoint = Checkpoint(saved.path)
    copy = checkpoint.load()
    assert checkpoint.claims == saved.claims, "the claims survive a downgrade"
    assert copy is not None and json.loads(Path(copy).read_text()) == document, "the newer file is kept whole"
    assert "written by a newer gpuppetti" in caplog.text


def test_a_directory_at_the_path_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "checkpoint.json").mkdir()
    (tmp_path / "checkpoint.json" / "inside").write_text("kept")
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    aside = checkpoint.load()
    assert aside is not None and (Path(aside) / "inside").read_text() == "kept"
    assert checkpoint.claims == {}
    assert "a directory, not a file" in caplog.text
    checkpoint.save({})
    assert Checkpoint(tmp_path / "checkpoint.json").load() is None


def test_a_checkpoint_that_cannot_be_moved_aside_says_what_to_do(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "checkpoint.json").write_text("not json")

    def refuse(source: object, target: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("gpuppetti.dra.checkpoint.os.rename", refuse)
    with pytest.raises(UnusableCheckpoint, match="cannot be moved aside: Permission denied; move it away"):
        Checkpoint(tmp_path / "checkpoint.json").load()



def _record(uid: str, state: str = COMPLETED, spec: dict[str, Any] | None = None) -> ClaimRecord:
    if state != COMPLETED:
        return ClaimRecord(uid, "default", f"claim-{uid}", STARTED, layer_allocations={"dra-x": [1 << 30]})
    spec = spec or {"cdiVersion": "0.3.0", "kind": "gpu.gpuppetti.dev/gpu", "devices": [
        {"name": f"claim-{uid}-gpu", "containerEdits": {"env": [f"GPUPPETTI_CLAIM={uid}", "Ü=\"quoted\""]}}]}
    return ClaimRecord(uid, "default", f"claim-{uid}", COMPLETED,
                       [PreparedDevice(["gpu"], "node1", "gpu-apple-0", [f"k/c=claim-{uid}-gpu"])],
                       cdi.encode_spec(spec).encode(), f"k-c_{uid}.json", {"dra-x": [1 << 30]})


def test_saves_write_what_a_fresh_encoding_would(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    started = {uid: _record(uid, STARTED) for uid in ("b", "a", "c")}
    checkpoint.save(started)
    # A record's spec (the bytes its CDI file holds) is written as they are, as a JSON object.
    completed = {**started, "a": _record("a"), "c": _record("c")}
    checkpoint.save(completed)
    written = checkpoint.path.read_bytes()
    assert json.loads(written)["claims"]["a"]["cdi_spec"] == json.loads(completed["a"].cdi_spec or b"")
    fresh = Checkpoint(tmp_path / "fresh.json")
    fresh.save(completed)
    assert written == fresh.path.read_bytes(), "byte for byte what encoding every record anew writes"
    loaded = Checkpoint(checkpoint.path)
    assert loaded.load() is None and loaded.claims == completed
    later = {"a": completed["a"], "b": _record("b")}
    checkpoint.save(later)
    anew = Checkpoint(tmp_path / "anew.json")
    anew.save(later)
    assert checkpoint.path.read_bytes() == anew.path.read_bytes()
    assert Checkpoint(checkpoint.path).load() is None


FIXTURE = Path(__file__).parent / "data" / "checkpoint-v1.json"


def test_a_checkpoint_written_by_the_first_v1_writer_is_restored(tmp_path: Path) -> None:
    # Byte for byte as the hand-spliced writer wrote it (with text that is not ASCII in a spec).
    shutil.copy(FIXTURE, tmp_path / "checkpoint.json")
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    assert checkpoint.load() is None, "not moved aside"
    claims = checkpoint.claims
    assert len(claims) == 3 and {record.state for record in claims.values()} == {COMPLETED, STARTED}
    first = claims["3f2a1b0c-0000-4000-8000-000000000001"]
    assert [device.device for device in first.devices] == ["gpu-apple-0", "gpu-apple-1"]
    assert first.layer_allocations == {"dra-3f2a1b0c-0000-4000-8000-000000000001-gpu": [1 << 30, 2 << 30]}
    document = json.loads(FIXTURE.read_bytes())["claims"]
    assert json.loads(first.cdi_spec or b"") == document[first.uid]["cdi_spec"]
    # Written again from its data: the same file.
    checkpoint.save(claims)
    assert checkpoint.path.read_bytes() == FIXTURE.read_bytes()


def test_the_order_of_the_fields_in_the_file_is_no_part_of_its_checksum(tmp_path: Path) -> None:
    document = json.loads(FIXTURE.read_bytes())
    shuffle = random.Random(7).shuffle

    def shuffled(value: Any) -> Any:
        if isinstance(value, dict):
            keys = list(value)
            shuffle(keys)
            return {key: shuffled(value[key]) for key in keys}
        if isinstance(value, list):
            return [shuffled(item) for item in value]
        return value

    (tmp_path / "checkpoint.json").write_text(json.dumps(shuffled(document), indent=1))
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    assert checkpoint.load() is None
    original = Checkpoint(tmp_path / "original.json")
    shutil.copy(FIXTURE, original.path)
    original.load()
    assert checkpoint.claims == original.claims


class _EvolvedRecord(ClaimRecord, frozen=True):
    # A field a later version adds: its name sorts between two of today's (cdi_spec and devices).
    cdi_version: str = "0.3.0"


def test_a_field_added_to_the_records_is_written_checksummed_and_restored(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(checkpoint_module, "ClaimRecord", _EvolvedRecord)
    base = _record("3f2a1b0c-0000-4000-8000-000000000009")
    evolved = _EvolvedRecord(**msgspec.structs.asdict(base), cdi_version="1.0.0")
    saved = Checkpoint(tmp_path / "checkpoint.json")
    saved.save({evolved.uid: evolved})
    assert json.loads(saved.path.read_bytes())["claims"][evolved.uid]["cdi_version"] == "1.0.0"
    restored = Checkpoint(saved.path)
    assert restored.load() is None, "not taken for a corrupt file"
    assert restored.claims == {evolved.uid: evolved}


@pytest.mark.parametrize(("where", "value"), [
    ("cdi_file", "../outside.json"), ("cdi_file", "/etc/passwd"), ("cdi_file", "a/b.json"), ("cdi_file", ".."),
    ("cdi_file", ""), ("layer_allocations", {"../../victim": [1]}), ("layer_allocations", {"a/b": [1]}),
    ("uid", "../x"),
])
def test_a_path_from_the_checkpoint_that_leaves_its_directory_is_corrupt(
        tmp_path: Path, where: str, value: Any, caplog: pytest.LogCaptureFixture) -> None:
    # The checksum is valid: what wrote the file wrote a path that is not a file name.
    path = _saved(tmp_path).path
    document = json.loads(path.read_text())
    document["claims"]["uid-1"][where] = value
    document["checksum"] = _legacy_checksum(document["claims"])
    path.write_text(json.dumps(document))
    checkpoint = Checkpoint(path)
    assert checkpoint.load() is not None and checkpoint.claims == {}
    assert "is corrupt" in caplog.text and not path.exists()


def test_an_oversized_checkpoint_is_moved_aside_unread(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    path = _saved(tmp_path).path
    with path.open("ab") as file:
        file.truncate(checkpoint_module.MAX_BYTES + 1)
    read: list[int] = []
    real_decode = checkpoint_module.decode

    def decode(raw: bytes) -> tuple[dict[str, ClaimRecord], str]:
        read.append(len(raw))
        return real_decode(raw)

    monkeypatch.setattr(checkpoint_module, "decode", decode)
    checkpoint = Checkpoint(path)
    aside = checkpoint.load()
    assert aside is not None and Path(aside).stat().st_size == checkpoint_module.MAX_BYTES + 1
    assert not read, "never read whole"
    assert "over the 32 MiB a checkpoint of 10,000 claims stays within" in caplog.text


def test_the_size_bound_holds_ten_thousand_claims_of_several_devices(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    uids = [f"3f2a1b0c-0000-4000-8000-{n:012d}" for n in range(10_000)]
    def record(uid: str) -> ClaimRecord:
        # Four GPUs, each with its share and the layer's mount, as a large claim of this driver's has them.
        edits = {"env": [f"GPUPPETTI_CLAIM={uid}", "GPUPPETTI_SHARING=consumable", "GPUPPETTI_LIMITS=vulkan",
                         f"GPUPPETTI_SHARE_ID={uid}", "GPUPPETTI_MEMORY=17179869184", "GPUPPETTI_CORES=40",
                         "GPUPPETTI_VISIBLE=GPU-0,GPU-1,GPU-2,GPU-3"],
                 "deviceNodes": [{"path": f"/dev/dri/renderD{128 + n}"} for n in range(4)],
                 "mounts": [{"hostPath": f"/var/lib/gpuppetti/vulkan/dra-{uid}-gpu",
                             "containerPath": "/run/gpuppetti/slices", "options": ["ro", "bind"]}]}
        spec = {"cdiVersion": "0.3.0", "kind": "gpu.gpuppetti.dev/gpu",
                "devices": [{"name": f"claim-{uid}-gpu", "containerEdits": edits}]}
        devices = [PreparedDevice(["gpu"], "node1", f"gpu-nvidia-{n}-share", [f"gpu.gpuppetti.dev/gpu=claim-{uid}-gpu"]
                                  if n == 0 else [], uid) for n in range(4)]
        return ClaimRecord(uid, "a-long-namespace-name", "a-claim-with-a-long-name", COMPLETED, devices,
                           cdi.encode_spec(spec).encode(), f"gpu.gpuppetti.dev-gpu_{uid}.json",
                           {f"dra-{uid}-gpu": [17 << 30] * 4})

    checkpoint.save({uid: record(uid) for uid in uids})
    assert checkpoint.path.stat().st_size < checkpoint_module.MAX_BYTES
    assert Checkpoint(checkpoint.path).load() is None


def test_the_file_is_the_document_type_whole_and_its_checksum_is_over_the_claims_as_written(tmp_path: Path) -> None:
    records = {uid: _record(uid) for uid in ("b", "a")}
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    checkpoint.save(records)
    written = checkpoint.path.read_bytes()
    assert written.endswith(b"}\n") and written.count(b"\n") == 1
    document = msgspec.json.decode(written, type=checkpoint_module.Document)
    assert document.version == "v1"
    assert document.checksum == hashlib.sha256(bytes(document.claims)).hexdigest()
    assert checkpoint_module.decode(written) == (records, "v1")
    assert list(json.loads(bytes(document.claims))) == ["a", "b"], "the claims in their canonical order"


def test_a_save_is_one_durable_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[dict[str, Any]] = []

    def atomic_write(path: Path, data: Any, **options: Any) -> None:
        writes.append(options)
        fsutil.atomic_write(path, data, **options)

    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(checkpoint_module, "atomic_write", atomic_write)
    monkeypatch.setattr("gpuppetti.base.fsutil.os.fsync", fsync)
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    checkpoint.save({uid: _record(uid) for uid in ("a", "b", "c")})
    assert len(writes) == 1 and writes[0].get("durable", True), "one write, fsynced"
    assert synced, "the file is fsynced"


def test_a_checksum_of_the_first_v1_writers_is_migrated_on_load(tmp_path: Path) -> None:
    # Text that is not ASCII outside a spec: the first writers' checksum escaped it, today's does not.
    record = _record("3f2a1b0c-0000-4000-8000-00000000000a")
    record = msgspec.structs.replace(record, devices=[PreparedDevice(["gpü"], "node1", "gpu-apple-0", [])])
    claims = {**json.loads(msgspec.json.encode(msgspec.structs.asdict(record) | {"cdi_spec": None})),
              "cdi_spec": json.loads(record.cdi_spec or b"")}
    document = {"version": "v1", "checksum": _legacy_checksum({record.uid: claims}), "claims": {record.uid: claims}}
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps(document))
    checkpoint = Checkpoint(path)
    assert checkpoint.load() is None, "not taken for a corrupt file"
    assert checkpoint.claims == {record.uid: record}
    checkpoint.save(checkpoint.claims)
    rewritten = json.loads(path.read_bytes())
    assert rewritten["checksum"] != document["checksum"], "written again with today's checksum"
    assert Checkpoint(path).load() is None


def test_a_record_holds_its_spec_and_devices_compactly() -> None:
    # Held for every prepared claim: the spec's bytes as they were encoded (not a copy of them), and neither the
    # record nor its devices tracked by the cyclic collector.
    spec = spec_json(cdi.encode_spec({"cdiVersion": "0.6.0", "kind": "gpu.gpuppetti.dev/gpu", "devices": []}))
    device = PreparedDevice(["gpu"], "node1", "gpu-apple-0", ["gpu.gpuppetti.dev/gpu=claim-u1-gpu"])
    record = ClaimRecord("u1", "default", "c1", COMPLETED, [device], spec, "gpu.gpuppetti.dev-gpu_u1.json")
    assert record.cdi_spec is spec
    assert not gc.is_tracked(record) and not gc.is_tracked(device)
    assert not hasattr(spec, "__dict__")
    decoded, _ = decode(encode({"u1": record}))
    assert decoded["u1"] == record and not gc.is_tracked(decoded["u1"])
