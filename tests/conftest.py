"""Shared fixtures. Keep this file small: put fixtures used by one package in its own conftest."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from rlhf.envvars import CLUSTER_ENV, cpu_env

# Set at import, not in a fixture: huggingface_hub and tokenizers read these when first
# imported, which happens while test modules are collected, before any fixture runs.
TEST_ENV = {k: CLUSTER_ENV[k] for k in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM")}
os.environ.update(TEST_ENV)


@pytest.fixture(scope="session", autouse=True)
def _test_env() -> None:
    """Re-assert the env for the session (subprocesses and Ray workers inherit it)."""
    os.environ.update(TEST_ENV)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random-init tiny Llama (hidden 128, 2 layers, GQA 2/1 heads) + word-level tokenizer."""
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random-init tiny Qwen2 (q/k/v biases) + word-level tokenizer."""
    from rlhf.models.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", seed=1)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for the whole session (8 logical CPUs on the 2 cores: the workers mostly wait).

    Started only if Ray is not up yet, and shut down at the end only if started here. Yields
    the ``ray`` module. A module fixture that starts Ray itself must likewise leave running a
    Ray it did not start.
    """
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, runtime_env={"env_vars": cpu_env()})
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def tok(tiny_llama_dir: Path):
    """The tiny Llama's tokenizer (modules that need another tokenizer define their own ``tok``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that starts Ray (and with it DeepSpeed ranks or vLLM engines) must be marked
    ``e2e``, so that ``-m "not e2e"`` stays the fast loop the README promises."""
    unmarked = [
        i.nodeid for i in items if "ray_session" in i.fixturenames and i.get_closest_marker("e2e") is None
    ]
    if unmarked:
        raise pytest.UsageError("tests that start Ray must carry @pytest.mark.e2e: " + ", ".join(unmarked))


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """A real S3-compatible server (moto's server mode) on a free loopback port; yields its
    ``host:port``. Credentials travel in the URIs (``s3_uri``), so Ray workers need no env."""
    import shutil
    import socket
    import subprocess
    import sys
    import time
    import urllib.request

    exe = shutil.which("moto_server", path=str(Path(sys.executable).parent)) or shutil.which("moto_server")
    if exe is None:
        pytest.fail("moto_server not found: scripts/setup.sh installs the dev extra (moto[server])")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [exe, "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/moto-api/", timeout=2)
            break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"moto_server did not answer on port {port} within 60 s")
            time.sleep(0.2)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture
def s3_uri(s3_server: str, request: pytest.FixtureRequest) -> str:
    """``s3://`` URI of a fresh bucket on ``s3_server`` (one per test)."""
    import re
    import uuid

    import pyarrow.fs as pafs

    bucket = (
        re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:6]
    )
    query = f"endpoint_override={s3_server}&scheme=http&region=us-east-1"
    fs, _ = pafs.FileSystem.from_uri(f"s3://test:test@{bucket}?{query}&allow_bucket_creation=true")
    fs.create_dir(bucket)
    return f"s3://test:test@{bucket}/run?{query}"
