"""launch/submit.sh without a cluster: its options, and the `ray job submit` it builds (a `ray`
on PATH that records its arguments). tests/launch/test_job_submit.py submits for real."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.cpu

REPO = Path(__file__).resolve().parents[2]
SUBMIT = REPO / "launch" / "submit.sh"


def test_submit_sh_parses() -> None:
    subprocess.run(["bash", "-n", str(SUBMIT)], check=True)
    assert os.access(SUBMIT, os.X_OK), "launch/submit.sh is not executable"


def test_submit_sh_help() -> None:
    result = subprocess.run([str(SUBMIT), "-h"], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("usage: launch/submit.sh")
    for flag in ("--address", "--entry", "--no-wait"):
        assert flag in result.stdout


def test_submit_sh_rejects_unknown_option() -> None:
    result = subprocess.run([str(SUBMIT), "--adress", "x"], capture_output=True, text=True)
    assert result.returncode == 2
    assert "unknown option" in result.stderr


@pytest.fixture
def fake_ray(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A `ray` on PATH that records its arguments and working directory instead of submitting."""
    record = tmp_path / "record"
    fake = tmp_path / "bin" / "ray"
    fake.parent.mkdir()
    fake.write_text(f'#!/usr/bin/env bash\n{{ pwd; printf "%s\\n" "$@"; }} > "{record}"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PATH"] = f"{fake.parent}{os.pathsep}{env['PATH']}"
    return env, record


def _run_submit(env: dict[str, str], record: Path, *args: str) -> tuple[str, list[str]]:
    subprocess.run([str(SUBMIT), *args], env=env, cwd="/", check=True)
    cwd, *argv = record.read_text().splitlines()
    return cwd, argv


def test_submit_sh_builds_ray_job_submit(fake_ray: tuple[dict[str, str], Path]) -> None:
    env, record = fake_ray
    cwd, argv = _run_submit(
        env,
        record,
        "--address",
        "http://head:8265",
        "--entry",
        "rlhf.grpo",
        "--no-wait",
        "--",
        "a=1",
        "b=x y",
    )
    # working_dir "." in runtime_env.yaml only means the checkout when ray runs from the repo root.
    assert Path(cwd) == REPO
    assert argv == [
        "job", "submit", "--address", "http://head:8265", "--runtime-env", "launch/runtime_env.yaml",
        "--no-wait", "--", "python", "-m", "rlhf.grpo", "a=1", "b=x y",
    ]  # fmt: skip


def test_submit_sh_defaults(fake_ray: tuple[dict[str, str], Path]) -> None:
    env, record = fake_ray
    _, argv = _run_submit(env, record)
    assert argv == [
        "job", "submit", "--address", "http://127.0.0.1:8265", "--runtime-env", "launch/runtime_env.yaml",
        "--", "python", "-m", "rlhf.ppo",
    ]  # fmt: skip
    _, argv = _run_submit({**env, "RAY_ADDRESS": "http://from-env:8265"}, record, "--", "x=1")
    assert argv[2:4] == ["--address", "http://from-env:8265"]
    assert argv[-1] == "x=1"
