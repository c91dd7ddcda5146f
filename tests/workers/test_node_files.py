"""The pieces of rlhf.workers.node_files that run on each node (the multi-node behaviour itself is
tested on a local cluster of three nodes, one with a disk of its own: tests/launch)."""

from __future__ import annotations

from rlhf.workers.node_files import _fingerprint, _write_tree


def test_a_shipped_tree_is_the_same_files_and_lands_whole(tmp_path, tiny_llama_dir):
    files = {
        str(f.relative_to(tiny_llama_dir)): f.read_bytes() for f in tiny_llama_dir.rglob("*") if f.is_file()
    }
    dest = tmp_path / "nodes" / "model"
    assert _fingerprint(str(dest)) is None
    assert _write_tree(str(dest), files) is None
    assert _fingerprint(str(dest)) == _fingerprint(str(tiny_llama_dir))
    assert [p.name for p in dest.parent.iterdir()] == ["model"]  # no staging dir left behind
    # a second shipment (another job) leaves the copy in place
    assert _write_tree(str(dest), {"config.json": b"{}"}) is None
    assert _fingerprint(str(dest)) == _fingerprint(str(tiny_llama_dir))


def test_a_path_that_cannot_be_written_comes_back_as_a_message(tmp_path):
    (tmp_path / "file").write_text("x")
    err = _write_tree(str(tmp_path / "file" / "model"), {"config.json": b"{}"})
    assert err is not None and "NotADirectoryError" in err
