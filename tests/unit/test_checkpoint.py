from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpuppetti.core import cdi
from gpuppetti.dra.checkpoint import COMPLETED, STARTED, Checkpoint, ClaimRecord, PreparedDevice, UnusableCheckpoint


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
        from gpuppetti.dra.checkpoint import _checksum

        document["checksum"] = _checksum(document["claims"])
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


def test_saves_encode_only_new_records_and_write_what_a_fresh_encoding_would(tmp_path: Path) -> None:
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    started = {uid: _record(uid, STARTED) for uid in ("b", "a", "c")}
    checkpoint.save(started)
    # A record's spec (the bytes its CDI file holds) is spliced in rather than encoded again, as a JSON object.
    completed = {**started, "a": _record("a"), "c": _record("c")}
    checkpoint.save(completed)
    written = checkpoint.path.read_bytes()
    assert json.loads(written)["claims"]["a"]["cdi_spec"] == json.loads(completed["a"].cdi_spec or b"")
    fresh = Checkpoint(tmp_path / "fresh.json")
    fresh.save(completed)
    assert written == fresh.path.read_bytes(), "byte for byte what encoding every record anew writes"
    loaded = Checkpoint(checkpoint.path)
    assert loaded.load() is None and loaded.claims == completed
    # Records kept as they are keep their encoding; a replaced one is encoded again; a removed one goes.
    later = {"a": completed["a"], "b": _record("b")}
    checkpoint.save(later)
    anew = Checkpoint(tmp_path / "anew.json")
    anew.save(later)
    assert checkpoint.path.read_bytes() == anew.path.read_bytes()
    assert Checkpoint(checkpoint.path).load() is None
