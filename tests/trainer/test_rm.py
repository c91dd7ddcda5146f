"""Reward model: last-token scores against plain HF, pairwise training, the saved dir as PPO's reward role, e2e."""

from __future__ import annotations

import pytest
import torch

from rlhf.algorithms.losses import pairwise_rm_loss
from rlhf.config import compose
from rlhf.data.chat import load_preferences
from rlhf.data.packing import pack
from rlhf.data.types import Sample
from rlhf.trainer.pref_objectives import RMObjective

from ._helpers import tiny_trainer_cfg

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pairs(tok):
    pairs, _ = load_preferences("toy:count", tok, max_len=128, num_toy=12, seed=2)
    return pairs


@pytest.fixture(scope="module")
def rm(tiny_llama_dir):
    from rlhf.models.forward import build_value_model

    return build_value_model(tiny_llama_dir, init_from_causal_lm=True, attn_impl="auto").eval()


def _hf_scores(model, samples) -> torch.Tensor:
    """Plain transformers sequence classification, one sample at a time (no pad token inside)."""
    with torch.no_grad():
        return torch.stack([model(input_ids=s.input_ids[None]).logits[0, 0].float() for s in samples])


def test_score_at_last_token_equals_per_sample_reference_and_loss_matches(rm, pairs):
    from rlhf.models.forward import packed_sequence_scores

    samples = [s for p in pairs for s in p]
    assert all(int(s.input_ids.eq(rm.config.pad_token_id).sum()) == 0 for s in samples)
    units = [[2 * k, 2 * k + 1] for k in range(len(pairs))]
    mbs = pack(samples, max(len(c) + len(r) for c, r in pairs), units=units)
    assert len(mbs) > 1
    got = torch.full((len(samples),), float("nan"))
    obj = RMObjective()
    with torch.no_grad():
        for mb in mbs:
            got[mb.sample_index] = packed_sequence_scores(rm, mb)
        total = sum(obj(rm, mb, obj.loss_weight(mb))[0] for mb in mbs) / sum(
            obj.loss_weight(mb) for mb in mbs
        )
    expected = _hf_scores(rm, samples)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(total, pairwise_rm_loss(expected[0::2], expected[1::2]), rtol=1e-5, atol=1e-6)


@pytest.mark.e2e
@pytest.mark.parametrize("sp", [1, 2], ids=["one-rank", "sequence-parallel-2"])
def test_pairwise_accuracy_rises_and_saved_dir_is_a_sequence_classifier(
    ray_session, tmp_path, tiny_llama_dir, pairs, sp
):
    from transformers import AutoModelForSequenceClassification

    from rlhf.trainer.rm_trainer import RMTrainer
    from rlhf.trainer.setup import model_group

    # sp=2: each packed row (pairs kept together) split over 2 ranks of one sequence-parallel group.
    cfg = tiny_trainer_cfg(
        "rm",
        tmp_path,
        tiny_llama_dir,
        "train.lr=0.002",
        f"model.sequence_parallel_size={sp}",
        f"cluster.reward_ranks={sp}",
    )
    pairs = pairs[:10]
    samples = [s for p in pairs for s in p]
    budget = cfg.train.max_tokens_per_microbatch
    # The reward role with lr > 0 trains, starting from the causal-LM dir with a fresh head.
    with model_group(cfg, "reward", str(tiny_llama_dir), sp, cfg.train.lr) as group:
        init = AutoModelForSequenceClassification.from_pretrained(tiny_llama_dir, num_labels=1).eval()
        init.load_state_dict(group.get_weights())
        torch.testing.assert_close(
            torch.stack(group.forward(samples, budget)), _hf_scores(init, samples), rtol=1e-5, atol=1e-5
        )
        trainer = RMTrainer(cfg, group, pairs, eval_pairs=pairs)
        before = trainer.evaluate()
        stats = [trainer.train_step(pairs) for _ in range(6)]
        after = trainer.evaluate()
        scores = torch.stack(group.forward(samples, budget))
        group.save_hf(str(tmp_path / "final"))
    assert stats[0]["loss"] == pytest.approx(before["loss"], rel=1e-4)
    assert after["loss"] < before["loss"] - 0.1
    assert after["scores/accuracy"] > before["scores/accuracy"] or after["scores/accuracy"] == 1.0
    assert after["scores/accuracy"] >= 0.9
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "final").eval()
    assert model.config.num_labels == 1 and type(model).__name__ == "LlamaForSequenceClassification"
    # The saved head and trunk give, in plain transformers, the scores the group trained.
    torch.testing.assert_close(_hf_scores(model, samples), scores, rtol=1e-4, atol=1e-4)


@pytest.mark.e2e
def test_rm_entry_point_end_to_end_and_ppo_reward_role_loads_it(ray_session, tmp_path, tiny_llama_dir, pairs):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlhf.rm import run
    from rlhf.workers.deepspeed_worker import DeepSpeedSettings
    from rlhf.workers.group import ModelGroup

    history = run(tiny_trainer_cfg("rm", tmp_path, tiny_llama_dir, "train.max_steps=3"))
    assert [h["step"] for h in history] == [0, 1, 2, 3]  # 0: the eval before training
    assert "eval/scores/accuracy" in history[0] and "eval/scores/accuracy" in history[-1]
    final = tmp_path / "final"
    assert len(AutoTokenizer.from_pretrained(final)) > 0
    model = AutoModelForSequenceClassification.from_pretrained(final).eval()
    samples = [Sample(s.input_ids, s.action_mask) for p in pairs[:3] for s in p]
    # What `python -m rlhf.ppo reward.type=model reward.model_path=<final>` builds for scoring (lr 0).
    reward = ModelGroup("reward", str(final), 1, DeepSpeedSettings(lr=0.0))
    try:
        scores = torch.stack(reward.forward(samples, 512))
    finally:
        reward.shutdown()
    torch.testing.assert_close(scores, _hf_scores(model, samples), rtol=1e-4, atol=1e-4)
    assert compose(
        "ppo", ["experiment=toy_count", "reward.type=model", f"reward.model_path={final}"]
    ).reward.model_path == str(final)
