"""What an entry point prints around its run (rlhf.cli): one line for a failure, the summary."""

from __future__ import annotations

import pytest

from rlhf import cli
from rlhf.config import compose


def test_a_failure_that_is_not_a_users_mistake_is_one_line_with_the_traceback_in_the_run_dir(
    tmp_path, capsys
):
    cfg = compose("sft", ["experiment=toy_chat", f"train.output_dir={tmp_path}"])

    def run(cfg):
        raise RuntimeError("placement: nodes 127.0.0.4 never came back")

    with pytest.raises(SystemExit) as e:
        cli.run_job(run, cfg)
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: RuntimeError: placement: nodes 127.0.0.4 never came back (traceback: {tmp_path / 'logs' / 'error.log'})"
    ]
    assert "Traceback (most recent call last)" in (tmp_path / "logs" / "error.log").read_text()


def test_the_summary_of_a_resumed_run_tells_its_own_share():
    history = [{"step": s, "train/loss": 1.0 / s} for s in range(1, 15)]
    text = cli.run_summary(history, "/nonexistent", 75.0, resumed_after=7)
    assert text.splitlines()[0] == "done: 14 steps, 7 of them in this run (resumed after step 7) in 75 s"
    assert cli.run_summary(history, "/nonexistent", 75.0).splitlines()[0] == "done: 14 steps in 75 s"
