"""rlhf.storage against a local directory and a real S3-compatible server (moto's server mode),
and the run checkpoints of rlhf.trainer.checkpoint written through it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rlhf.storage import Store, is_uri, local_mirror, redact, staged_read, staged_write
from rlhf.trainer.checkpoint import latest_checkpoint, load_latest, prune_checkpoints, save_checkpoint


class FileGroup:
    """A stand-in for ``ModelGroup`` with two "ranks" that each write their own file through the
    same staging the workers use (no DeepSpeed needed to test the layout)."""

    def __init__(self, value: int):
        self.value = value

    def save_checkpoint(self, path: str) -> None:
        for rank in (0, 1):
            with staged_write(path, f"r{rank}") as local:
                Path(local).mkdir(parents=True, exist_ok=True)  # as DeepSpeed does
                (Path(local) / f"rank{rank}.json").write_text(json.dumps(self.value))

    def load_checkpoint(self, path: str) -> None:
        with staged_read(path, "r0") as local:
            vals = [json.loads((Path(local) / f"rank{r}.json").read_text()) for r in (0, 1)]
        assert vals[0] == vals[1]
        self.value = vals[0]


def test_uri_detection_and_redaction(tmp_path):
    assert is_uri("s3://b/x") and is_uri("gs://b") and not is_uri("/x/y") and not is_uri("file:///x")
    assert redact("s3://key:secret@bucket/run?scheme=http") == "s3://***@bucket/run?scheme=http"
    assert local_mirror(tmp_path) == tmp_path.absolute()
    assert local_mirror("s3://b/run") != local_mirror("s3://b/other")


@pytest.fixture(params=["local", "s3"])
def location(request, tmp_path):
    return str(tmp_path / "out") if request.param == "local" else request.getfixturevalue("s3_uri")


def test_store_round_trip(location, tmp_path):
    store = Store(location)
    assert not store.exists("a") and store.list_dirs("nothing") == []
    store.write_text("a/b.txt", "hello")
    assert store.is_file("a/b.txt") and store.read_text("a/b.txt") == "hello" and store.list_dirs("") == ["a"]
    tree = tmp_path / "tree"
    (tree / "sub").mkdir(parents=True)
    (tree / "sub" / "x.bin").write_bytes(b"\0\1")
    store.upload(tree, "c")
    assert store.list_files("c") == ["sub/x.bin"]
    store.download("c", tmp_path / "back")
    assert (tmp_path / "back" / "sub" / "x.bin").read_bytes() == b"\0\1"
    store.delete("c")
    assert not store.exists("c") and store.exists("a/b.txt")


def test_checkpoints_through_a_uri_or_a_dir(location):
    assert latest_checkpoint(location) is None
    for step in (1, 2, 3):
        save_checkpoint(location, step, {"g": FileGroup(step)}, {"step": step}, {"blob": [step]}, keep=2)
    store = Store(location)
    # every rank's part is stored, pruning removed step_1 with all its parts
    assert sorted(store.list_dirs("checkpoints")) == ["step_2", "step_3"]
    assert store.is_file("checkpoints/step_3/g/rank0.json") and store.is_file(
        "checkpoints/step_3/g/rank1.json"
    )
    assert latest_checkpoint(location) == store.uri("checkpoints/step_3")
    group = FileGroup(0)
    ckpt = load_latest(location, {"g": group}, blobs=("blob", "missing"))
    assert (group.value, ckpt.state, ckpt.blobs) == (3, {"step": 3}, {"blob": [3]})
    prune_checkpoints(location, keep=1)
    assert store.list_dirs("checkpoints") == ["step_3"]


def test_latest_moves_only_after_every_part_is_stored(location):
    save_checkpoint(location, 1, {"g": FileGroup(1)}, {"step": 1})

    class DiesMidSave(FileGroup):
        def save_checkpoint(self, path: str) -> None:
            with staged_write(path, "r0") as local:
                Path(local).mkdir(parents=True, exist_ok=True)
                (Path(local) / "rank0.json").write_text("2")
                raise ConnectionError("node lost")  # the upload of this part never happens

    with pytest.raises(ConnectionError):
        save_checkpoint(location, 2, {"g": DiesMidSave(2)}, {"step": 2})
    assert latest_checkpoint(location) == Store(location).uri("checkpoints/step_1")


def test_a_bad_uri_names_the_setting():
    with pytest.raises(ValueError, match="train.output_dir='nosuchfs://x' is not a storage URI"):
        Store("nosuchfs://x")


def test_a_driver_that_holds_no_rank_saves_its_state(location):
    """A KubeRay head with num-cpus=0: no rank on the driver's node made the step directory."""
    path = save_checkpoint(location, 1, {}, {"step": 1}, {"pending": [1, 2]})
    assert path == Store(location).uri("checkpoints/step_1")
    assert load_latest(location, {}, blobs=("pending",)).blobs == {"pending": [1, 2]}
