"""Run assembly checks that need no Ray: the model directory."""

from __future__ import annotations

import shutil

import pytest

from rlhf.config.schema import ModelConfig
from rlhf.trainer.setup import TOKENIZER_FILES, prepare_model_dir


def test_model_dir_without_tokenizer_says_so(tiny_llama_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    assert prepare_model_dir(ModelConfig(path=str(model)), str(tmp_path)) == str(model)
    for f in TOKENIZER_FILES:
        (model / f).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=r"model.path=.* has no tokenizer \(none of tokenizer.json"):
        prepare_model_dir(ModelConfig(path=str(model)), str(tmp_path))


def test_model_dir_without_config_says_so(tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        prepare_model_dir(ModelConfig(path=str(tmp_path)), str(tmp_path))


class _FlakyRayStart:
    """Injected fault (a loaded machine cannot be summoned in a test): the first ``failures``
    starts raise what ray.init raises when its raylet misses Ray's fixed 30 s registration wait."""

    def __init__(self, failures: int, clock: list[float], seconds_per_attempt: float):
        self.failures, self.clock, self.dt = failures, clock, seconds_per_attempt
        self.starts = self.stops = 0

    def start(self) -> None:
        self.starts += 1
        self.clock[0] += self.dt
        if self.starts <= self.failures:
            raise Exception(
                "The current node timed out during startup. This could happen because some of the raylet "
                "failed to startup or the GCS has become overloaded."
            )

    def stop(self) -> None:
        self.stops += 1


def test_local_ray_start_is_retried_with_a_clear_message(caplog):
    from rlhf.trainer.setup import start_local_ray

    clock = [0.0]
    flaky = _FlakyRayStart(1, clock, 35.0)
    with caplog.at_level("WARNING", logger="rlhf"):
        assert start_local_ray(flaky.start, flaky.stop, 120.0, clock=lambda: clock[0]) == 2
    assert (flaky.starts, flaky.stops) == (2, 1)  # the failed attempt's processes were stopped
    assert any("trying again (attempt 2" in r.getMessage() for r in caplog.records)

    # every attempt fails: retried (at least once) until cluster.ray_start_timeout_s, then one message
    clock[0] = 0.0
    always = _FlakyRayStart(10**6, clock, 35.0)
    with pytest.raises(
        RuntimeError, match=r"did not start in 4 attempts over 140 s .*cluster.ray_start_timeout_s"
    ):
        start_local_ray(always.start, always.stop, 120.0, clock=lambda: clock[0])
    clock[0] = 0.0
    short = _FlakyRayStart(10**6, clock, 35.0)
    with pytest.raises(RuntimeError, match="in 2 attempts"):  # one retry even with a short timeout
        start_local_ray(short.start, short.stop, 1.0, clock=lambda: clock[0])

    # any other error is not a slow start: raised at once, no retry
    def bad() -> None:
        raise ValueError("num_cpus must be >= 0")

    with pytest.raises(ValueError, match="num_cpus"):
        start_local_ray(bad, always.stop, 120.0)
