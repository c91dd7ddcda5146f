"""Packed SFT: loss against a per-sample plain HF reference, training through the real ModelGroup, e2e."""

from __future__ import annotations

import pytest
import torch

from rlhf.data.chat import load_sft, tokenize_conversation
from rlhf.data.packing import pack
from rlhf.trainer.objectives import SFTObjective

from ._helpers import tiny_trainer_cfg

ray = pytest.importorskip("ray")

CHATS = [
    [
        {"role": "user", "content": "count 3 4"},
        {"role": "assistant", "content": "5 6 7"},
        {"role": "user", "content": "next"},
        {"role": "assistant", "content": "8 9"},
        {"role": "tool", "content": "result ok"},
        {"role": "assistant", "content": "10 11 12 13"},
    ],
    [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello"}],
    [
        {"role": "system", "content": "answer yes or no"},
        {"role": "user", "content": "is 3 a number"},
        {"role": "assistant", "content": "yes"},
        {"role": "user", "content": "and a"},
        {"role": "assistant", "content": "no"},
    ],
]


@pytest.fixture(scope="module")
def samples(tok):
    toy, _ = load_sft("toy:count", tok, max_len=128, num_toy=5)
    return [tokenize_conversation(tok, c) for c in CHATS] + toy


@pytest.fixture(scope="module")
def lm(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.models.forward import prepare_model_for_packing

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prepare_model_for_packing(model)
    return model


def _reference_nll(model, s) -> tuple[torch.Tensor, int]:
    """Plain per-sample HF forward: summed NLL of the assistant tokens and their count."""
    with torch.no_grad():
        logits = model(input_ids=s.input_ids[None]).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, s.input_ids[1:, None])[:, 0]
    mask = s.action_mask[1:]
    return -lp[mask].sum(), int(mask.sum())


def _assistant_segments(mask: torch.Tensor) -> int:
    m = mask.int()
    return int(((m[1:] == 1) & (m[:-1] == 0)).sum())


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"])
@pytest.mark.parametrize("budget", [64, 4096])
def test_packed_loss_equals_unpacked_reference(lm, samples, aggregation, budget):
    # Several assistant turns per chat: the mask must select each of them and nothing else.
    assert _assistant_segments(samples[0].action_mask) == 3
    assert _assistant_segments(samples[3].action_mask) == 2
    obj = SFTObjective(aggregation=aggregation)
    mbs = pack(samples, budget)
    assert (len(mbs) > 1) == (budget == 64)
    with torch.no_grad():
        weights = [obj.loss_weight(mb) for mb in mbs]
        losses = [obj(lm, mb, 1.0)[0] for mb in mbs]
    packed = sum(w * loss for w, loss in zip(weights, losses, strict=True)) / sum(weights)
    ref = [_reference_nll(lm, s) for s in samples]
    if aggregation == "token_mean":
        expected = sum(n for n, _ in ref) / sum(c for _, c in ref)
    elif aggregation == "seq_mean_token_mean":
        expected = torch.stack([n / c for n, c in ref]).mean()
    else:
        expected = torch.stack([n for n, _ in ref]).mean()
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def sft_group(ray_session, tiny_llama_dir, tmp_path_factory):
    """One real 1-rank actor group, shared by the ``fit`` tests (it keeps training across them).

    Placed without a placement group: ``model_group``'s is named per role, and the other tests of
    this module open their own ``rlhf-actor`` while this one is alive.
    """
    from rlhf.trainer.setup import deepspeed_settings
    from rlhf.workers.group import ModelGroup

    cfg = tiny_trainer_cfg("sft", tmp_path_factory.mktemp("sft_group"), tiny_llama_dir)
    group = ModelGroup(
        "actor", str(tiny_llama_dir), 1, deepspeed_settings(cfg.train, cfg.train.lr), seed=cfg.train.seed
    )
    yield group
    group.shutdown()


def _record_train_calls(monkeypatch, group) -> list[tuple[list[int], object, int]]:
    """Pass-through recorder, not a fake: logs what the trainer asks of ``group.train``, then runs it."""
    calls = []
    real_train = group.train

    def train(samples, objective, budget, num_minibatches=1, units=None):
        calls.append(([int(s.input_ids[1]) for s in samples], units, num_minibatches))
        return real_train(samples, objective, budget, num_minibatches=num_minibatches, units=units)

    monkeypatch.setattr(group, "train", train)
    return calls


@pytest.mark.e2e
@pytest.mark.parametrize(("max_steps", "steps"), [(0, 6), (4, 4)])
def test_fit_runs_shuffled_epochs_evaluates_and_saves(
    sft_group, monkeypatch, tmp_path, tiny_llama_dir, max_steps, steps
):
    from transformers import AutoModelForCausalLM

    from rlhf.data.types import Sample
    from rlhf.trainer.sft_trainer import SFTTrainer, sft_nll

    # Sample i is told apart by its second token, 10 + i.
    data = [Sample(input_ids=[1, 10 + i, 30 + i, 2], action_mask=[0, 0, 1, 1]) for i in range(10)]
    cfg = tiny_trainer_cfg(
        "sft",
        tmp_path,
        tiny_llama_dir,
        "train.epochs=2",
        "train.batch_size=4",
        f"train.max_steps={max_steps}",
    )
    calls = _record_train_calls(monkeypatch, sft_group)
    steps_before = sft_group.info()[0]["global_steps"]
    history = SFTTrainer(cfg, sft_group, data, eval_samples=data[:2]).fit()
    # a row before the first step holds the starting point of the held-out loss
    assert history[0]["step"] == 0 and set(history[0]) == {"step", "eval/loss"}
    history = history[1:]
    assert len(calls) == len(history) == steps
    # max_steps (or epochs x batches) optimizer steps really taken by the DeepSpeed engine
    assert sft_group.info()[0]["global_steps"] - steps_before == steps
    assert [len(c[0]) for c in calls] == [4, 4, 2, 4, 4, 2][:steps]
    assert all(units is None and n == 1 for _, units, n in calls)
    assert all(torch.isfinite(torch.tensor(h["train/loss"])) for h in history)
    if not max_steps:
        epoch0, epoch1 = [sum((c[0] for c in calls[k : k + 3]), []) for k in (0, 3)]
        assert sorted(epoch0) == sorted(epoch1) == [10 + i for i in range(10)] and epoch0 != epoch1
    # eval at the end of each epoch, or at the last step when max_steps cuts the run short
    evals = [h["step"] for h in history if "eval/loss" in h]
    assert evals == ([3, 6] if not max_steps else [3, 4])
    # The last eval saw the final weights: the held-out NLL under the group's own forward now.
    eval_samples = data[:2]
    final_nll = sft_nll(sft_group.forward(eval_samples, cfg.train.max_tokens_per_microbatch), eval_samples)
    assert history[-1]["eval/loss"] == pytest.approx(final_nll, rel=1e-5)
    assert history[-1]["eval/loss"] != pytest.approx(history[2]["eval/loss"], rel=1e-4)
    # <output_dir>/final is a transformers model holding exactly the trained weights.
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "final", dtype=torch.float32).state_dict()
    weights = sft_group.get_weights()
    assert set(weights) <= set(saved)
    for name, w in weights.items():
        torch.testing.assert_close(saved[name], w.float(), msg=name)


@pytest.mark.e2e
def test_sft_steps_through_the_group_decrease_loss(ray_session, tmp_path, tiny_llama_dir, tok):
    from rlhf.trainer.setup import model_group
    from rlhf.trainer.sft_trainer import SFTTrainer

    # Two ranks: dealing, dummy slots and the rank-weighted loss normaliser are all in play.
    cfg = tiny_trainer_cfg("sft", tmp_path, tiny_llama_dir, "cluster.actor_ranks=2", "train.lr=0.002")
    data, _ = load_sft("toy:count", tok, max_len=128, num_toy=12, seed=3)
    with model_group(cfg, "actor", str(tiny_llama_dir), 2, cfg.train.lr) as group:
        trainer = SFTTrainer(cfg, group, data, eval_samples=data)
        before = trainer.evaluate()["loss"]
        losses = [trainer.train_step([(s,) for s in data])["loss"] for _ in range(4)]
        after = trainer.evaluate()["loss"]
    # The first step's stat is the loss before any update: it must match the group's own forward.
    assert losses[0] == pytest.approx(before, rel=1e-4)
    assert after < before - 0.3
    assert losses == sorted(losses, reverse=True)


@pytest.mark.e2e
def test_sft_entry_point_end_to_end(ray_session, tmp_path, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    from rlhf.sft import run

    cfg = tiny_trainer_cfg("sft", tmp_path, tiny_llama_dir, "train.max_steps=3", "train.tensorboard=true")
    history = run(cfg)
    assert [h["step"] for h in history] == [0, 1, 2, 3]  # 0: the eval before training
    assert all(torch.isfinite(torch.tensor(h["train/loss"])) for h in history[1:])
    assert "eval/loss" in history[0] and "eval/loss" in history[-1]
    assert (tmp_path / "metrics.jsonl").is_file() and (tmp_path / "tensorboard").is_dir()
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert model.config.architectures == ["LlamaForCausalLM"]


@pytest.mark.e2e
def test_checkpoint_resume_continues_the_same_schedule(sft_group, tmp_path, tiny_llama_dir):
    """Stopping after step 2 and resuming gives the weights of an uninterrupted 4-step run."""
    from rlhf.data.types import Sample
    from rlhf.trainer.sft_trainer import SFTTrainer

    data = [Sample(input_ids=[1, 10 + i, 30 + i, 2], action_mask=[0, 0, 1, 1]) for i in range(10)]
    args = ("train.epochs=2", "train.batch_size=4", "train.max_steps=4", "train.save_every=2")
    cfg = tiny_trainer_cfg("sft", tmp_path, tiny_llama_dir, *args)
    SFTTrainer(cfg, sft_group, data).fit()
    uninterrupted = sft_group.get_weights()
    latest = tmp_path / "checkpoints" / "latest"
    assert latest.read_text() == "step_4" and (tmp_path / "checkpoints" / "step_2").is_dir()
    latest.write_text("step_2")  # as if the run had died after step 2
    resumed_cfg = tiny_trainer_cfg("sft", tmp_path, tiny_llama_dir, *args, "train.resume=true")
    history = SFTTrainer(resumed_cfg, sft_group, data).fit()
    assert [h["step"] for h in history] == [1, 2, 3, 4]  # the run's rows: 1-2 kept, 3-4 done again
    after = sft_group.get_weights()
    for name, w in uninterrupted.items():
        torch.testing.assert_close(after[name], w, msg=name)
    # and the weights did move during the resumed steps (the check above is not vacuous)
    sft_group.load_checkpoint(str(tmp_path / "checkpoints" / "step_2" / "model"))
    at_two = sft_group.get_weights()
    assert any(not torch.equal(at_two[k], uninterrupted[k]) for k in uninterrupted)


@pytest.mark.e2e
def test_sigterm_to_the_process_group_checkpoints_and_the_run_resumes(tmp_path, tiny_llama_dir):
    """``kill -TERM -- -PGID`` (what Ctrl-C, ``timeout`` and container runtimes do) reaches the
    local Ray too: the run still checkpoints and exits 143 at once (the Ray it started is in a
    session of its own), and the same command resumes and logs every step once."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    steps = 16
    cmd = [
        sys.executable, "-m", "rlhf.sft", "experiment=toy_chat", f"model.path={tiny_llama_dir}",
        f"train.output_dir={tmp_path / 'run'}",
        "train.tensorboard=false", "data.num_toy=64", "data.eval_size=4", "train.batch_size=4",
        "train.epochs=10", f"train.max_steps={steps}", "train.stop_grace_s=120", f"hydra.run.dir={tmp_path / 'h'}",
    ]  # fmt: skip
    metrics = tmp_path / "run" / "metrics.jsonl"
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    deadline = time.monotonic() + 300
    while not metrics.is_file() or len(metrics.read_text().splitlines()) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended or stalled before step 2"
        time.sleep(0.1)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGTERM, log[-3000:]
    assert time.monotonic() - t0 < 120 and "Failed to connect to GCS" not in log, log[-3000:]
    done = (tmp_path / "run" / "checkpoints" / "latest").read_text()
    assert done.startswith("step_") and int(done[5:]) < steps, done
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == list(range(1, steps + 1))
    # the summary tells this run's share, and says "before -> after" from the eval before step 1
    first = int(done[5:])
    assert (
        f"done: {steps} steps, {steps - first} of them in this run (resumed after step {first})"
        in resumed.stdout
    )
    assert rows[0]["step"] == 0 and "eval/loss" in rows[0] and "eval loss: " in resumed.stdout
    # the driver's own log is beside the workers' (both runs' lines)
    driver_log = (tmp_path / "run" / "logs" / "driver.log").read_text()
    assert (
        "received SIGTERM" in driver_log
        and f"resuming from {tmp_path / 'run' / 'checkpoints' / done}" in driver_log
    )
