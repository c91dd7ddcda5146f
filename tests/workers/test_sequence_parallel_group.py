"""Sequence-parallel model groups on real Ray + DeepSpeed (CPU, gloo) against one process.

ZeRO-2 on 4 ranks (2 data-parallel shards x 2 sequence-parallel ranks) and ZeRO-3 on 2 ranks
(one shard split in two): the per-token log-probs equal a plain per-sample HF forward and one
SFT optimizer step equals a single process stepping on the whole batch, as the data-parallel
tests of ``test_deepspeed_group`` require of k = 1. The rows (20, 19 and 9 tokens) are split
mid-sample and two of them need a pad to split evenly.
"""

from __future__ import annotations

import pytest
import torch

from rlhf.trainer.objectives import SFTObjective
from tests.workers.test_deepspeed_group import (
    BUDGET,
    _hf_lm,
    _hf_logprobs,
    _max_diff,
    _reference_sft_step,
    _samples,
    _start,
    model_dir,  # noqa: F401 - fixture
    vocab,  # noqa: F401 - fixture
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module", params=[(2, 4), (3, 2)], ids=["zero2-4ranks", "zero3-2ranks"])
def sp_actor(request, ray_session, model_dir, tmp_path_factory):  # noqa: F811
    stage, ranks = request.param
    ckpt = tmp_path_factory.mktemp(f"ckpt_sp_zero{stage}")
    group = _start("actor", model_dir, ranks, stage, ckpt, sequence_parallel_size=2)
    group.init_ckpt = str(ckpt)
    yield group
    group.shutdown()


def test_sequence_parallel_forward_and_step_equal_one_process(sp_actor, model_dir, vocab) -> None:  # noqa: F811
    assert {i["attn_impl"] for i in sp_actor.info()} == {"ulysses_packed_sdpa"}
    samples = _samples(vocab, seed=1)
    out = sp_actor.forward(samples, BUDGET)
    ref = _hf_lm(model_dir, sp_actor.get_weights())
    with torch.no_grad():
        for s, lp in zip(samples, out, strict=True):
            torch.testing.assert_close(lp, _hf_logprobs(ref, s), atol=1e-5, rtol=0)

    sp_actor.load_checkpoint(sp_actor.init_ckpt, tag="init")
    w0 = sp_actor.get_weights()
    samples = _samples(vocab)
    stats = sp_actor.train(samples, SFTObjective(), BUDGET)
    expected, ref_loss, ref_norm = _reference_sft_step(model_dir, w0, samples, "token_mean")
    got = sp_actor.get_weights()
    assert _max_diff(got, w0) > 1e-4  # the step moved the weights
    assert _max_diff(got, expected) < 1e-5
    assert stats["loss"] == pytest.approx(ref_loss, rel=1e-5)
    assert stats["grad_norm"] == pytest.approx(ref_norm, rel=1e-4)
