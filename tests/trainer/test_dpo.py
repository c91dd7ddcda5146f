"""Packed DPO: per-sequence sums and the loss against per-sample plain HF references, pairing, training, e2e."""

from __future__ import annotations

import random

import pytest
import torch

from rlhf.algorithms.losses import dpo_loss
from rlhf.config import compose
from rlhf.data.chat import load_preferences
from rlhf.data.packing import pack
from rlhf.data.types import Sample
from rlhf.models.forward import packed_logprobs
from rlhf.trainer.pref_objectives import DPOObjective, pair_layout, sequence_logprob_sums

from ._helpers import tiny_trainer_cfg

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def pairs(tok):
    pairs, _ = load_preferences("toy:count", tok, max_len=128, num_toy=10, seed=1)
    return pairs


def _flat(pairs):
    return [s for p in pairs for s in p], [[2 * k, 2 * k + 1] for k in range(len(pairs))]


@pytest.fixture(scope="module")
def lm(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.models.forward import prepare_model_for_packing

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prepare_model_for_packing(model)
    return model


def _reference_sum(model, s: Sample) -> torch.Tensor:
    """Plain per-sample HF forward: log p summed over the response (action) tokens."""
    with torch.no_grad():
        logits = model(input_ids=s.input_ids[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, s.input_ids[1:, None])[:, 0]
    return lp[s.action_mask[1:]].sum()


def _budget(pairs) -> int:
    # The smallest budget that fits the longest pair: forces many micro-batches.
    return max(len(c) + len(r) for c, r in pairs)


def test_packed_sums_equal_unpacked_and_pairs_stay_together(lm, pairs):
    samples, units = _flat(pairs)
    mbs = pack(samples, _budget(pairs), units=units)
    assert len(mbs) > 2
    got = torch.full((len(samples),), float("nan"))
    with torch.no_grad():
        for mb in mbs:
            pair_layout(mb)  # raises unless (chosen 2k, rejected 2k+1) sit next to each other
            got[mb.sample_index] = sequence_logprob_sums(packed_logprobs(lm, mb)[0], mb)
    expected = torch.stack([_reference_sum(lm, s) for s in samples])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seed", range(5))
def test_a_pair_is_never_split_even_with_a_small_budget(seed):
    rng = random.Random(seed)
    samples = []
    for _ in range(13):
        for _ in range(2):
            n = rng.randint(2, 30)
            samples.append(Sample(input_ids=torch.arange(n), action_mask=torch.arange(n) >= n // 2))
    units = [[2 * k, 2 * k + 1] for k in range(13)]
    budget = max(len(samples[a]) + len(samples[b]) for a, b in units)
    mbs = pack(samples, budget, units=units)
    seen = []
    for mb in mbs:
        idx = mb.sample_index.tolist()
        assert mb.num_tokens <= budget
        # chosen 2k immediately followed by its rejected 2k+1
        assert all(a % 2 == 0 and b == a + 1 for a, b in zip(idx[0::2], idx[1::2], strict=True))
        pair_layout(mb)
        seen += idx
    assert sorted(seen) == list(range(len(samples)))
    # Without units, a split pair is caught rather than silently mismatched.
    with pytest.raises(ValueError, match="pairs"):
        for mb in pack(samples, budget):
            pair_layout(mb)


@pytest.mark.parametrize(("beta", "label_smoothing"), [(0.1, 0.0), (0.5, 0.2)])
def test_dpo_objective_equals_dpo_loss_on_reference_sums(lm, pairs, beta, label_smoothing):
    g = torch.Generator().manual_seed(0)
    samples = []
    for c, r in pairs:
        for s in (c, r):
            # A reference that differs from the policy, so the ref terms really enter the loss.
            samples.append(
                Sample(
                    input_ids=s.input_ids,
                    action_mask=s.action_mask,
                    ref_logprobs=-3 * torch.rand(len(s), generator=g),
                )
            )
    _, units = _flat(pairs)
    obj = DPOObjective(beta=beta, label_smoothing=label_smoothing)
    mbs = pack(samples, _budget(pairs), units=units)
    with torch.no_grad():
        total = sum(obj(lm, mb, obj.loss_weight(mb))[0] for mb in mbs) / sum(
            obj.loss_weight(mb) for mb in mbs
        )
    pol = torch.stack([_reference_sum(lm, s) for s in samples])
    ref = torch.stack([s.ref_logprobs[s.action_mask].sum() for s in samples])
    expected, _, _ = dpo_loss(pol[0::2], pol[1::2], ref[0::2], ref[1::2], beta, label_smoothing)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    assert obj.loss_weight(mbs[0]) == mbs[0].num_samples // 2
    dummy = obj.dummy_batch()
    loss, _ = obj(lm, dummy, 0.0)
    assert dummy.num_samples == 2 and float(loss.detach()) == 0.0


def test_trainer_needs_reference_logprobs(tmp_path, pairs):
    from rlhf.trainer.dpo_trainer import DPOTrainer

    cfg = compose(
        "dpo", ["experiment=toy_chat", "train.lr=5e-4", f"train.output_dir={tmp_path}", "train.batch_size=3"]
    )
    bare = [(Sample(c.input_ids, c.action_mask), Sample(r.input_ids, r.action_mask)) for c, r in pairs[:4]]
    # Refused in the constructor, before the group is used: no group is needed to check it.
    with pytest.raises(ValueError, match="fill_reference"):
        DPOTrainer(cfg, None, bare)
    for c, r in bare[:3]:
        c.ref_logprobs, r.ref_logprobs = torch.zeros(len(c)), torch.zeros(len(r))
    assert len(DPOTrainer(cfg, None, bare[:3]).train_units) == 3
    # One held-out sample without a reference is enough.
    with pytest.raises(ValueError, match="fill_reference"):
        DPOTrainer(cfg, None, bare[:3], eval_pairs=[(bare[0][0], bare[3][1])])


@pytest.mark.e2e
@pytest.mark.parametrize("sp", [1, 2], ids=["one-rank", "sequence-parallel-2"])
def test_dpo_steps_through_the_group_keep_pairs_together_and_raise_the_margin(
    ray_session, tmp_path, tiny_llama_dir, pairs, sp
):
    from rlhf.trainer.dpo_trainer import DPOTrainer, fill_reference
    from rlhf.trainer.setup import model_group

    pairs = [(Sample(c.input_ids, c.action_mask), Sample(r.input_ids, r.action_mask)) for c, r in pairs[:8]]
    # A budget of about two pairs per micro-batch: packed sample by sample, some pair is split (checked
    # here), and DPOObjective's pair_layout on the rank would raise. Only units=pairs trains.
    budget = 48
    samples, units = _flat(pairs)
    with pytest.raises(ValueError, match="pairs"):
        for mb in pack(samples, budget):
            pair_layout(mb)
    assert len(pack(samples, budget, units=units)) > 2
    # data.max_len=24 (these samples are shorter): the config insists that 2 x data.max_len <= budget.
    assert max(len(s) for s in samples) <= 24
    cfg = tiny_trainer_cfg(
        "dpo",
        tmp_path,
        tiny_llama_dir,
        "train.lr=0.001",
        "data.max_len=24",
        f"train.max_tokens_per_microbatch={budget}",
        # sp=2: every row split over the 2 ranks of one sequence-parallel group
        f"model.sequence_parallel_size={sp}",
        f"cluster.actor_ranks={sp}",
        f"cluster.ref_ranks={sp}",
    )
    with model_group(cfg, "actor", str(tiny_llama_dir), sp, cfg.train.lr) as policy:
        # Before any step the policy *is* the reference (same weights): use it as such.
        fill_reference(policy, pairs, cfg.train.max_tokens_per_microbatch)
        trainer = DPOTrainer(cfg, policy, pairs, eval_pairs=pairs)
        before = trainer.evaluate()
        stats = [trainer.train_step(pairs) for _ in range(3)]
        after = trainer.evaluate()
    assert before["rewards/margin"] == pytest.approx(0.0, abs=1e-4)
    assert before["loss"] == pytest.approx(torch.log(torch.tensor(2.0)).item(), abs=1e-4)
    assert stats[0]["loss"] == pytest.approx(before["loss"], abs=1e-4)
    # The margin is measured with the true (chosen, rejected) order: a trainer that swapped them
    # in a pair would lower it.
    assert after["rewards/margin"] > 0.05
    assert after["loss"] < before["loss"]
    assert stats[-1]["rewards/margin"] > stats[0]["rewards/margin"]


@pytest.mark.e2e
def test_dpo_entry_point_end_to_end(ray_session, tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.dpo import run

    history = run(tiny_trainer_cfg("dpo", tmp_path, tiny_llama_dir, "train.max_steps=2"))
    assert [h["step"] for h in history] == [0, 1, 2]  # 0: the eval before training
    # Step 1 trains the untouched policy: implicit rewards are exactly 0, loss log 2.
    assert history[1]["train/loss"] == pytest.approx(0.6931, abs=1e-3)
    assert "eval/rewards/accuracy" in history[-1]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final").config.architectures == [
        "LlamaForCausalLM"
    ]
