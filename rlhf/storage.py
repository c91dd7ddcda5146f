"""Where a run's outputs live: a local directory or a storage URI (``s3://``, ``gs://``, ``hdfs://``,
``abfs://`` ... through ``pyarrow.fs``).

A local ``train.output_dir`` must be one directory that every node of the cluster sees (NFS, a
KubeRay PVC, or a one-node cluster): ranks write their checkpoint shards into it directly, and a
multi-node run checks that it is shared before it starts (``rlhf.workers.node_files``).

With a URI, nothing is shared: each process writes into a node-local staging directory and
uploads what it wrote (``staged_write``); a resume downloads first (``staged_read``). The run's
own files on the driver (metrics, TensorBoard, the tiny model) live in the driver's staging copy
of the output dir (``local_mirror``) and are uploaded at every checkpoint and at the end. Staging
goes under ``$RLHF_STAGING_DIR`` (default: the system temp dir), on each node.

Credentials and endpoints come from the usual places of each filesystem on every node (for S3
the ``AWS_*`` variables or an instance profile; an S3-compatible server through the URI, e.g.
``s3://bucket/run?endpoint_override=host:9000&scheme=http``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "STAGING_ENV",
    "Store",
    "is_uri",
    "local_mirror",
    "redact",
    "staged_read",
    "staged_write",
    "staging_root",
]

STAGING_ENV = "RLHF_STAGING_DIR"


def is_uri(location: str | Path) -> bool:
    """True for ``scheme://...`` other than ``file://``: outputs that no node sees as a path."""
    s = str(location)
    return "://" in s and not s.startswith("file://")


_SECRET_PARAM = re.compile(r"([?&][^=&]*(?:key|secret|token|password|credential)[^=&]*=)[^&]*", re.IGNORECASE)


def redact(location: str | Path) -> str:
    """``location`` without credentials, for logs: ``s3://key:secret@bucket`` -> ``s3://***@bucket``,
    ``?access_key=A&secret_key=S`` -> ``?access_key=***&secret_key=***``."""
    text = re.sub(r"^([a-z0-9+.-]+://)[^/@]+@", r"\1***@", str(location))
    return _SECRET_PARAM.sub(r"\1***", text)


def staging_root() -> Path:
    """This node's staging directory (``$RLHF_STAGING_DIR`` or ``<tmp>/rlhf-staging``)."""
    return Path(os.environ.get(STAGING_ENV) or Path(tempfile.gettempdir()) / "rlhf-staging")


def _key(location: str) -> str:
    return hashlib.sha1(location.encode()).hexdigest()[:16]


def local_mirror(location: str | Path) -> Path:
    """The directory the driver writes the run's own files in: ``location`` itself when it is a
    path, else a staging copy that ``Store.upload`` sends to the URI."""
    if not is_uri(location):
        return Path(location).absolute()
    return staging_root() / "runs" / _key(str(location))


class Store:
    """Files under one location, addressed by ``/``-separated paths relative to it."""

    def __init__(self, location: str | Path):
        self.location = str(location).rstrip("/") if is_uri(location) else str(Path(location).absolute())
        self.remote = is_uri(self.location)
        import pyarrow.fs as pafs

        if self.remote:
            try:
                self.fs, self.root = pafs.FileSystem.from_uri(self.location)
            except Exception as e:
                raise ValueError(
                    f"train.output_dir={redact(self.location)!r} is not a storage URI pyarrow can open ({e}). "
                    "Use s3://bucket/path (endpoint through ?endpoint_override=host:port&scheme=http), "
                    "gs://bucket/path, hdfs://..., or a directory every node shares"
                ) from e
        else:
            self.fs, self.root = pafs.LocalFileSystem(), self.location

    def __repr__(self) -> str:
        return f"Store({redact(self.location)!r})"

    def uri(self, rel: str = "") -> str:
        """The location of ``rel``, as a path or URI (what workers are handed)."""
        if not rel:
            return self.location
        if not self.remote:
            return str(Path(self.location) / rel)
        base, _, query = self.location.partition("?")
        return f"{base}/{rel}" + (f"?{query}" if query else "")

    def _p(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def exists(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self._p(rel)).type != pafs.FileType.NotFound

    def is_file(self, rel: str) -> bool:
        import pyarrow.fs as pafs

        return self.fs.get_file_info(self._p(rel)).type == pafs.FileType.File

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open_input_stream(self._p(rel)) as f:
            return f.read()

    def read_text(self, rel: str) -> str:
        return self.read_bytes(rel).decode()

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Whole or not at all: a local file is renamed into place; an object store's PUT is atomic."""
        if self.remote:
            with self.fs.open_output_stream(self._p(rel)) as f:
                f.write(data)
            return
        path = Path(self._p(rel))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)

    def write_text(self, rel: str, text: str) -> None:
        self.write_bytes(rel, text.encode())

    def list_dirs(self, rel: str) -> list[str]:
        """Names of the directories directly under ``rel`` (none if it does not exist)."""
        import pyarrow.fs as pafs

        sel = pafs.FileSelector(self._p(rel), allow_not_found=True)
        return [i.base_name for i in self.fs.get_file_info(sel) if i.type == pafs.FileType.Directory]

    def list_files(self, rel: str = "") -> list[str]:
        """Paths (relative to ``rel``) of every file under ``rel``, sorted."""
        import pyarrow.fs as pafs

        base = self._p(rel).rstrip("/") + "/"
        infos = self.fs.get_file_info(pafs.FileSelector(self._p(rel), recursive=True, allow_not_found=True))
        return sorted(i.path[len(base) :] for i in infos if i.type == pafs.FileType.File)

    def delete(self, rel: str) -> None:
        import pyarrow.fs as pafs

        info = self.fs.get_file_info(self._p(rel))
        if info.type == pafs.FileType.Directory:
            self.fs.delete_dir(self._p(rel))
        elif info.type == pafs.FileType.File:
            self.fs.delete_file(self._p(rel))

    def upload(self, local: str | Path, rel: str = "") -> None:
        """Copy the file or directory tree ``local`` to ``rel``."""
        import pyarrow.fs as pafs

        local = Path(local)
        dest = self._p(rel)
        if local.is_dir():
            if not self.remote:
                shutil.copytree(local, dest, dirs_exist_ok=True)
                return
            pafs.copy_files(str(local), dest, pafs.LocalFileSystem(), self.fs)
        elif self.remote:
            pafs.copy_files(str(local), dest, pafs.LocalFileSystem(), self.fs)
        else:
            Path(dest).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(local, dest)

    def download(self, rel: str, local: str | Path) -> None:
        """Copy ``rel`` (a file or a directory tree) to ``local``."""
        import pyarrow.fs as pafs

        is_dir = self.fs.get_file_info(self._p(rel)).type == pafs.FileType.Directory
        # copy_files makes the subdirectories of a tree, not its top
        (Path(local) if is_dir else Path(local).parent).mkdir(parents=True, exist_ok=True)
        pafs.copy_files(self._p(rel), str(local), self.fs, pafs.LocalFileSystem())


@contextlib.contextmanager
def staged_write(location: str, tag: str) -> Iterator[str]:
    """A directory to write ``location``'s files into: ``location`` itself when it is a path;
    for a URI a fresh node-local directory (``tag`` keeps processes of one node apart) that is
    uploaded when the block ends without an error, then deleted."""
    if not is_uri(location):
        yield location
        return
    local = staging_root() / "write" / f"{_key(location)}-{tag}-{uuid.uuid4().hex[:8]}"
    local.mkdir(parents=True)
    try:
        yield str(local)
        Store(location).upload(local)
    finally:
        shutil.rmtree(local, ignore_errors=True)


@contextlib.contextmanager
def staged_read(location: str, tag: str) -> Iterator[str]:
    """A directory holding ``location``'s files for the span of the block: the path itself, or
    for a URI a node-local download of it (deleted afterwards)."""
    if not is_uri(location):
        yield location
        return
    store = Store(location)
    if not store.exists(""):
        raise FileNotFoundError(
            f"{redact(location)} does not exist: the checkpoint is incomplete or was deleted"
        )
    local = staging_root() / "read" / f"{_key(location)}-{tag}-{uuid.uuid4().hex[:8]}"
    try:
        store.download("", local)
        yield str(local)
    finally:
        shutil.rmtree(local, ignore_errors=True)
