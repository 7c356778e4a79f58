from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpuppetti.dra.checkpoint import COMPLETED, Checkpoint, ClaimRecord, PreparedDevice, UnusableCheckpoint


def _saved(tmp_path: Path) -> Checkpoint:
    checkpoint = Checkpoint(tmp_path / "checkpoint.json")
    checkpoint.save({"uid-1": ClaimRecord(
        "uid-1", "default", "claim", COMPLETED,
        [PreparedDevice(["gpu"], "node1", "gpu-apple-0", ["k/c=claim-uid-1-gpu"], "s1")],
        {"cdiVersion": "0.3.0"}, "k-c_uid-1.json")})
    return checkpoint


def test_round_trip(tmp_path: Path) -> None:
    saved = _saved(tmp_path)
    loaded = Checkpoint(saved.path)
    assert loaded.load() is None
    assert loaded.claims == saved.claims
    assert oct(saved.path.stat().st_mode & 0o777) == "0o600"
    assert not list(tmp_path.glob(".checkpoint.json.*")), "no temporary file is left behind"


@pytest.mark.parametrize("damage", ["truncate", "checksum", "shape", "binary"])
def test_damage_is_detected_and_moved_aside(tmp_path: Path, damage: str, caplog: pytest.LogCaptureFixture) -> None:
    path = _saved(tmp_path).path
    raw = path.read_text()
    if damage == "truncate":
        path.write_text(raw[: len(raw) // 2])
    elif damage == "checksum":
        path.write_text(raw.replace("gpu-apple-0", "gpu-apple-1"))
    elif damage == "shape":
        document = json.loads(raw)
        document["claims"]["uid-1"]["unexpected"] = 1
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


def test_a_directory_at_the_path_is_refused_with_what_to_do(tmp_path: Path) -> None:
    (tmp_path / "checkpoint.json").mkdir()
    with pytest.raises(UnusableCheckpoint, match="is a directory, not a file: remove it"):
        Checkpoint(tmp_path / "checkpoint.json").load()

