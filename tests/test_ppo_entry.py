"""The main job (`python -m rlhf.ppo`, README) on the local CPU: real Ray, vLLM, DeepSpeed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from rlhf.config import compose

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]


def test_default_job_reward_rises(tmp_path):
    """The default experiment, shortened: the toy reward must visibly rise."""
    from rlhf.ppo import run

    cfg = compose(
        "ppo",
        [
            "experiment=toy_count",
            f"train.output_dir={tmp_path}",
            "train.num_steps=40",
            "train.tensorboard=false",
        ],
    )
    history = run(cfg)
    rewards = [h["reward/mean"] for h in history]
    assert len(rewards) == 40
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.05, f"reward did not rise: first 8 steps {first:.3f}, last 8 steps {last:.3f}"
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(0 < r["packing/budget_fill"] <= 1 and r["packing/left_pad_fraction"] > 0 for r in rows)
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_40"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlhf.ppo", *args], capture_output=True, text=True, timeout=120
    )


def _one_clear_error(proc: subprocess.CompletedProcess) -> str:
    """A user's mistake: exit code 2, one message on stderr, no Python traceback there."""
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-2000:]
    return errors[0]


def test_cli_rejects_bad_key_before_starting_anything(tmp_path):
    msg = _one_clear_error(
        _cli("experiment=toy_count", "algorithm.not_a_key=1", f"train.output_dir={tmp_path}")
    )
    assert "algorithm.not_a_key" in msg and "+algorithm" not in msg
    assert not (tmp_path / "tiny_model").exists()
    # a misspelt key names the closest schema field
    msg = _one_clear_error(_cli("experiment=toy_count", "train.num_step=3", f"train.output_dir={tmp_path}"))
    assert "did you mean train.num_steps?" in msg
    msg = _one_clear_error(_cli("experiment=toy_count", "trian.num_steps=3"))
    assert "did you mean train.num_steps?" in msg
    # a storage URI with a query, unquoted for Hydra: how to quote it
    proc = _cli("experiment=toy_count", "train.output_dir=s3://b/run?endpoint_override=h:9000&scheme=http")
    _one_clear_error(proc)
    assert "must be quoted" in proc.stderr and "'train.output_dir=\"s3://" in proc.stderr


def test_cli_semantic_error_names_field(tmp_path):
    msg = _one_clear_error(
        _cli(
            "experiment=toy_count",
            "algorithm=rloo",
            "rollout.n_samples_per_prompt=1",
            f"train.output_dir={tmp_path}",
        )
    )
    assert "rollout.n_samples_per_prompt" in msg


def test_cli_data_and_reward_mistakes_are_one_message_with_the_traceback_in_the_log(tmp_path):
    """Errors found after the config composed: the data file and the reward function."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"question": "count 1 2 3"}\n')
    out = tmp_path / "run"
    msg = _one_clear_error(
        _cli(
            f"data.prompts={rows}",
            "reward.function=rlhf.rewards.verifiers:exact_match_reward",
            f"train.output_dir={out}",
        )
    )
    assert f"{rows}:1: missing column 'prompt'" in msg and "data.prompt_key" in msg
    assert f"traceback: {out / 'logs' / 'error.log'}" in msg
    assert "Traceback (most recent call last)" in (out / "logs" / "error.log").read_text()
    msg = _one_clear_error(
        _cli(
            f"data.prompts={rows}",
            "data.prompt_key=question",
            "reward.function=no_such_module:fn",
            f"train.output_dir={out}",
        )
    )
    assert "reward.function='no_such_module:fn'" in msg


def test_cli_without_data_or_reward_is_a_config_error_naming_the_keys(tmp_path):
    msg = _one_clear_error(_cli(f"train.output_dir={tmp_path}"))
    assert "data.prompts is not set" in msg and "experiment=toy_count" in msg
    msg = _one_clear_error(_cli("data.prompts=my.parquet", f"train.output_dir={tmp_path}"))
    assert "no reward" in msg
    for key in ("reward.function=", "reward.functions=", "reward.type=model", "env.name="):
        assert key in msg
    # the recipe's reward.functions and a reward.function on the command line: refused, not one ignored
    msg = _one_clear_error(
        _cli("experiment=rlvr_math", "reward.function=rlhf.rewards.verifiers:exact_match_reward")
    )
    assert "reward.function=" in msg and "reward.functions=" in msg and "both set" in msg
    assert not (tmp_path / "tiny_model").exists()


def test_separate_placement_reward_model_and_reinforce_pp(tmp_path, tiny_llama_dir):
    """Non-colocated roles (one placement group each), ZeRO-3, a reward *model* instead of a
    function, multi-turn rollouts from the CLI, several epochs and mini-batches."""
    import torch
    from transformers import AutoTokenizer

    from rlhf.models.forward import build_value_model
    from rlhf.ppo import run

    rm_dir = tmp_path / "rm"
    rm = build_value_model(tiny_llama_dir, init_from_causal_lm=True)
    with torch.no_grad():  # a reward model that prefers some tokens over others, not all-zero scores
        rm.score.weight.normal_(0, 0.5)
    rm.save_pretrained(rm_dir)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(rm_dir)
    cfg = compose(
        "ppo",
        [
            "experiment=toy_count",
            f"train.output_dir={tmp_path / 'run'}",
            "train.num_steps=2",
            "train.tensorboard=false",
            f"model.path={tiny_llama_dir}",
            "algorithm=reinforce_pp",
            "cluster.colocate=false",
            "reward.type=model",
            "train.zero_stage=3",
            "env.name=rlhf.envs.toy:EchoToolEnv",
            "train.ppo_epochs=2",
            "train.num_minibatches=2",
            f"reward.model_path={rm_dir}",
            "reward.clip=0",
        ],
    )
    history = run(cfg)
    assert len(history) == 2
    for h in history:
        assert torch.isfinite(torch.tensor([h["policy/loss"], h["reward/mean"], h["kl"]])).all(), h
        assert "critic/loss" not in h  # REINFORCE++ has no critic
        assert h["policy/num_optimizer_steps"] == 4  # 2 epochs x 2 mini-batches
        assert h["rollout/observation_tokens_mean"] > 0  # the tool turns made it into the samples
    assert history[0]["reward/std"] > 0, "reward-model scores should vary across samples"


def test_readme_rlvr_recipe_at_realistic_batch_sizes(tmp_path):
    """The README's GSM8K recipe, as its two commands, one step long but at the sizes that
    crashed vLLM's CPU engine (over ~4k prompt tokens in one seeded call): a step of 64 prompts
    x 8 samples and an evaluation of all ~200 held-out prompts x 4 samples (plus greedy)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, "-m", "rlhf.data.make_arith", "--out", "data/arith"],
        cwd=tmp_path, env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-m", "rlhf.ppo", "experiment=rlvr_math", "train.num_steps=1",
         "train.rollout_batch_size=64", "eval.max_prompts=200", "eval.n_samples=4", "train.tensorboard=false"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    out = tmp_path / "runs" / "rlvr_math"
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["step"] == 1 and "reward/mean" in r)
    assert step["rollout/num_samples"] == 64 * 8
    assert {"reward/math_verify_reward", "reward/format_reward"} <= step.keys()
    assert step["reward/verify_timeouts"] == 0.0  # counted every step, 0 included
    final = [r for r in rows if "eval/pass@4" in r]
    assert len(final) == 2  # before the first step and after the last
    assert all(r["eval/reward/verify_timeouts"] == 0.0 for r in final)
    # every test question: make_arith drops the few that also appear in train
    assert rows[-1]["eval/num_prompts"] == pq.read_table(tmp_path / "data/arith/test.parquet").num_rows
    # the engines' start-up noise went to their log file, not to the console
    from rlhf.workers.logs import ENGINE_NOISE

    console = proc.stdout + proc.stderr
    assert [n for n in ENGINE_NOISE if n in console] == []
    assert "FutureWarning" not in console and "LOAD REPORT" not in console
    engine_logs = "".join(p.read_text() for p in (out / "logs").glob("engine-*.log"))
    assert "Enforce eager set" in engine_logs and "Triton is installed" in engine_logs
    # the end-of-run summary names the results
    assert "done: 1 steps" in proc.stdout and f"model: {Path('runs/rlvr_math/final')}" in proc.stdout


def test_lora_ppo_with_critic_reference_for_free_and_adapter_sync(tmp_path, tiny_llama_dir):
    """model.lora on GAE PPO: actor and critic train adapters (+ the value head), the KL's
    reference is the actor with adapters off (no reference group is built), engines serve the
    synced adapter (engine vs trainer logprob gap stays at float noise), final is a PEFT dir."""
    from rlhf.ppo import run

    out = tmp_path / "run"
    cfg = compose(
        "ppo",
        [
            "experiment=toy_count",
            f"model.path={tiny_llama_dir}",
            "model.lora.rank=8",
            "train.num_steps=3",
            "train.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=2",
            "algorithm.kl_coef=0.1",
            f"train.output_dir={out}",
            "train.tensorboard=false",
        ],
    )
    history = run(cfg)
    assert [h["step"] for h in history] == [1, 2, 3]
    assert abs(history[0]["kl"]) < 1e-6  # LoRA B starts at 0: policy == reference
    assert abs(history[-1]["kl"]) > 1e-6  # then the adapter moves the policy away from it
    assert all(h["rollout/logprob_gap"] < 1e-4 for h in history)  # engines serve the trained adapter
    logs = {p.name for p in (out / "logs").iterdir()}
    assert "actor-0.log" in logs and "critic-0.log" in logs and "reference-0.log" not in logs
    assert sorted(p.name for p in (out / "final").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]


def test_cli_type_errors_and_bare_strings_for_lists_name_the_field_and_the_fix(tmp_path):
    """Each used to print only 'Error merging override ...' (and its traceback went to the system
    temp dir): now the field, its type and the value given, and the log under the run's dir."""
    out = tmp_path / "run"
    base = ("experiment=toy_count", f"train.output_dir={out}")
    assert _one_clear_error(_cli(*base, "train.num_steps=abc")) == (
        f"error: train.num_steps=abc: train.num_steps must be an integer, got 'abc' (traceback: {out / 'logs' / 'error.log'})"
    )
    msg = _one_clear_error(_cli(*base, "model.lora.target_modules=q_proj"))
    assert "model.lora.target_modules is a list; write model.lora.target_modules=[q_proj]" in msg
    assert "rollout.temperature must be a number, got 'hot'" in _one_clear_error(
        _cli(*base, "rollout.temperature=hot")
    )
    assert (out / "logs" / "error.log").is_file()


def _cfg_job_in_a_shell(override: str) -> subprocess.CompletedProcess:
    """``rlhf.ppo experiment=toy_count OVERRIDE --cfg job`` through a shell, quotes as typed."""
    return subprocess.run(
        f"{sys.executable} -m rlhf.ppo experiment=toy_count {override} --cfg job",
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_cfg_job_validates_and_masks_credentials(tmp_path):
    msg = _one_clear_error(_cli("experiment=toy_count", "rollout.temperature=0", "--cfg", "job"))
    assert "rollout.temperature" in msg
    uri = "'train.output_dir=\"s3://AKIA:SECRET@bucket/run?endpoint_override=h:9000&secret_key=S3CR3T&scheme=http\"'"
    proc = _cfg_job_in_a_shell(uri)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (
        "output_dir: s3://***@bucket/run?endpoint_override=h:9000&secret_key=***&scheme=http" in proc.stdout
    )
    assert "AKIA" not in proc.stdout and "S3CR3T" not in proc.stdout and "SECRET" not in proc.stdout
    # the documented storage URI example (docs/multi-node.md), as written there, reaches the config intact
    page = (Path(__file__).resolve().parents[1] / "docs" / "multi-node.md").read_text()
    example = next(line.strip() for line in page.splitlines() if "train.output_dir='s3://" in line)
    proc = _cfg_job_in_a_shell(example)
    assert "output_dir: s3://bucket/run?endpoint_override=host:9000&scheme=http" in proc.stdout, proc.stderr[
        -2000:
    ]


def test_check_reports_what_the_run_uses_and_finds_mistakes_in_seconds(tmp_path):
    """--check: no Ray, no worker; the data read and tokenized, the reward called."""
    import json
    import time

    rows = tmp_path / "rows.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"question": f"count {i} {i + 1}", "target": str(i + 2)}) + "\n" for i in range(50)
        )
    )
    base = (
        f"data.prompts={rows}", "data.prompt_key=question", "data.label_key=target", f"eval.prompts={rows}",
        "reward.function=rlhf.rewards.verifiers:exact_match_reward", f"train.output_dir={tmp_path / 'run'}",
    )  # fmt: skip
    t0 = time.monotonic()
    proc = _cli(*base, "--check")
    took = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "data: " in out and "50 prompts; columns the reward sees ['index', 'target']" in out
    assert "prompt tokens: p50" in out and "(limit 64; 0 over)" in out and "unknown-token share" in out
    assert "label column 'target'" in out and "placement: a local Ray" in out and "check passed" in out
    assert not (tmp_path / "run").exists() and took < 60, took
    # a label column that is not there: found by the reward call, before any worker
    msg = _one_clear_error(_cli(*base[:2], f"data.prompts={rows}", *base[3:], "--check"))
    assert "the verifier needs the label column 'answer'" in msg and "reward.label_key" in msg
    # an overlong prompt under overlong_prompts=error
    msg = _one_clear_error(_cli(*base, "data.max_prompt_len=3", "rollout.max_model_len=64", "--check"))
    assert "longer than data.max_prompt_len=3" in msg
