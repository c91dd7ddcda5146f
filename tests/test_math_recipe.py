"""The GSM8K recipe in miniature (python -m rlhf.math_recipe), shortened to its wiring: the data
files, a tokenizer that reads them, SFT on the worked solutions through the column mapping, and
GRPO (here on LoRA adapters) with the math verifier. The full runs' held-out accuracy before ->
after is measured in docs/recipes.md: ~5-10 min each is too long for CI."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pyarrow.parquet as pq
import pytest


def test_the_arith_files_hold_out_questions_and_their_answers_follow_the_solutions(tmp_path):
    from rlhf.data.make_arith import write

    files = write(tmp_path, num_train=500, num_test=100)
    train, test = (pq.read_table(files[k]).to_pylist() for k in ("train", "test"))
    assert len(train) == 500 and 90 <= len(test) <= 100
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    for r in train + test:
        steps = r["solution"].splitlines()
        assert steps[-1] == f"#### {r['answer']}"
        for step in steps[:-1]:  # "3 * 4 = 12": every worked step is right
            lhs, rhs = step.split(" = ")
            assert eval(lhs.replace("/", "//")) == int(rhs)  # noqa: S307 - "a op b" from the generator


def test_the_sft_file_cuts_the_given_share_of_solutions_to_the_bare_answer(tmp_path):
    from rlhf.data.make_arith import write, write_sft

    files = write(tmp_path, num_train=1000, num_test=10)
    train = pq.read_table(files["train"]).to_pylist()
    sft = pq.read_table(write_sft(files["train"], tmp_path / "sft.parquet", 0.3, seed=1)).to_pylist()
    assert [(r["question"], r["answer"]) for r in sft] == [(r["question"], r["answer"]) for r in train]
    bare = [s["solution"] == f"#### {s['answer']}" for s in sft]
    assert 0.25 < sum(bare) / len(sft) < 0.35  # 1000 draws at 0.3
    assert all(s == t for s, t, b in zip(sft, train, bare, strict=True) if not b)  # the others stay worked
    assert all(len(s["solution"].splitlines()) == 3 for s, b in zip(sft, bare, strict=True) if not b)
    assert write_sft(files["train"], tmp_path / "none.parquet", 0.0).is_file()
    with pytest.raises(ValueError, match="bare_share must be in"):
        write_sft(files["train"], tmp_path / "all.parquet", 1.0)


def test_a_bare_share_out_of_range_is_refused_before_anything_is_written(tmp_path, capsys):
    from rlhf.math_recipe import main

    with pytest.raises(SystemExit) as e:
        main(["--bare-share", "1", "--output-dir", str(tmp_path / "out")])
    assert e.value.code == 2
    assert "--bare-share must be in [0, 1)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_task_tokenizer_reads_the_problems(tmp_path):
    from transformers import AutoTokenizer

    from rlhf.data.make_arith import write
    from rlhf.math_recipe import build_model

    files = write(tmp_path / "data", num_train=300, num_test=20)
    tok = AutoTokenizer.from_pretrained(build_model(tmp_path, files["train"], 128, 1))
    rows = pq.read_table(files["test"]).to_pylist()  # text the tokenizer was not trained on
    for r in rows:
        ids = tok(r["question"] + "\n" + r["solution"], add_special_tokens=False)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == r["question"] + "\n" + r["solution"]
    digits = tok("12 + 345", add_special_tokens=False)["input_ids"]
    assert len(digits) == 7  # 1 2 ' +' ' ' 3 4 5: one token per digit, as in Qwen's


@pytest.mark.e2e
def test_the_lora_recipe_runs_sft_then_grpo_with_the_math_verifier(tmp_path):
    out = tmp_path / "recipe"
    cmd = [sys.executable, "-m", "rlhf.math_recipe", "--lora", "--output-dir", str(out)]
    cmd += ["--sft-steps", "150", "--rl-steps", "2", "--train-rows", "1000", "--test-rows", "32"]
    cmd += ["eval.every=2", "train.rollout_batch_size=8"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(
        r"held-out greedy accuracy [\d.]+% -> [\d.]+% over 2 GRPO steps \(lora_grpo\)", proc.stdout
    )
    rows = [json.loads(x) for x in (out / "grpo" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 2]
    # the SFT warm start taught the format: samples end in "#### X" and some are right
    train = [r for r in rows if "reward/format_reward" in r]
    assert train and min(r["reward/format_reward"] for r in train) > 0.8
    assert evals[0]["eval/pass@8"] > 0
    assert (out / "grpo" / "final" / "adapter_config.json").is_file()
    assert (out / "progress.png").stat().st_size > 10_000
