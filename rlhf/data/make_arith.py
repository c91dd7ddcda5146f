"""Write the bundled arithmetic word problems as Parquet (train and held-out test), the layout
of a GSM8K user's own files: ``question`` (the prompt), ``answer`` (the final number) and
``solution``; and, for a warm start, an SFT file whose solutions are partly bare answers.

    python -m rlhf.data.make_arith --out data/arith     # then: python -m rlhf.ppo experiment=rlvr_math
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rlhf.data.toy import arithmetic_word_problems


def write(out: str | Path, num_train: int = 2000, num_test: int = 200, seed: int = 0) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = arithmetic_word_problems(num_train + num_test, seed)
    train, seen = rows[:num_train], {r["question"] for r in rows[:num_train]}
    test = [r for r in rows[num_train:] if r["question"] not in seen]  # held out: never trained on
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files = {"train": out / "train.parquet", "test": out / "test.parquet"}
    pq.write_table(pa.Table.from_pylist(train), files["train"])
    pq.write_table(pa.Table.from_pylist(test), files["test"])
    return files


def write_sft(train: str | Path, out: str | Path, bare_share: float, seed: int = 0) -> Path:
    """The training split with a ``bare_share`` of its solutions cut to the final answer
    (``#### 17``), the rest worked, as SFT sets mix (worked solutions from one source, answers
    only from another). A model warm-started on it answers some questions outright and works
    others out; the verifier's reward is what tells it which pays (``rlhf.math_recipe``)."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    if not 0.0 <= bare_share < 1.0:
        raise ValueError(f"bare_share must be in [0, 1), got {bare_share}")
    rng = random.Random(seed)
    rows = pq.read_table(train).to_pylist()
    for r in rows:
        if rng.random() < bare_share:
            r["solution"] = f"#### {r['answer']}"
    pq.write_table(pa.Table.from_pylist(rows), out)
    return Path(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="data/arith")
    p.add_argument("--num-train", type=int, default=2000)
    p.add_argument("--num-test", type=int, default=200)
    args = p.parse_args()
    for split, path in write(args.out, args.num_train, args.num_test).items():
        print(f"{split}: {path}")


if __name__ == "__main__":
    main()
