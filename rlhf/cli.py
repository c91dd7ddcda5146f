"""What the entry points (``rlhf.ppo``, ``sft``, ``dpo``, ``rm``) share around their ``run``.

- The config is composed and validated before Hydra starts the job, so a mistake costs no
  start-up and reads as one line: an unknown key names the closest schema field ("did you
  mean train.num_steps?") instead of Hydra's "+key" advice.
- Mistakes a user made (config, data, reward: ``USER_ERRORS``) print one message (what,
  where, the fix) without a Python traceback and exit with code 2; the traceback goes to a
  log file the message names. Anything else is a bug or a failure and keeps its traceback.
- A finished run ends with a short summary (steps, wall time, first -> last reward or loss,
  eval before -> after, where the model, checkpoints, metrics and logs are).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlhf.config import CONF_DIR, SCHEMAS, ConfigError, compose, compose_raw, to_object
from rlhf.data.chat import DataRowError
from rlhf.rewards import RewardFunctionError
from rlhf.workers.node_files import NodeFilesError

log = logging.getLogger("rlhf")

# A malformed config, data file or reward function: FileNotFoundError covers a missing data
# file or checkpoint, ValueError every check that names a field (ConfigError, DataRowError).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    DataRowError,
    RewardFunctionError,
    FileNotFoundError,
    ValueError,
    NodeFilesError,
)
USER_ERROR_EXIT = 2
# Config groups selected by name (model=hf), besides the schema's own fields.
GROUPS = ("model", "rollout", "algorithm", "cluster", "experiment")


def schema_keys(schema: type) -> list[str]:
    """Every dotted field path of a dataclass schema (``train.num_steps``, ``model.tiny.arch``, ...)."""
    keys = []
    for f in dataclasses.fields(schema):
        sub = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub):
            keys += [f"{f.name}.{k}" for k in schema_keys(type(sub))]
        else:
            keys.append(f.name)
    return keys


def unknown_key_message(config_name: str, overrides: Sequence[str]) -> str | None:
    """A one-line message for the first override whose key the schema does not have, with the
    closest field; None when every key exists (the error was something else)."""
    known = set(schema_keys(SCHEMAS[f"{config_name}_schema"])) | set(GROUPS)
    for arg in overrides:
        key = arg.split("=", 1)[0].lstrip("+~")
        if key in known or key.startswith("hydra."):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.8)
        same_leaf = [k for k in sorted(known) if k.rpartition(".")[2] == key.rpartition(".")[2]]
        hint = close or same_leaf[:1]
        suggestion = f" (did you mean {hint[0]}?)" if hint else ""
        return (
            f"unknown config key {key!r} in {arg!r}{suggestion}; the fields are listed in "
            f"rlhf/config/schema.py and `python -m rlhf.{config_name} --cfg job` prints them all"
        )
    return None


def _hydra_errors() -> tuple[type[BaseException], ...]:
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    return (HydraException, OmegaConfBaseException)


def _override_type_message(e: BaseException, overrides: Sequence[str]) -> str | None:
    """``train.num_steps=abc`` -> what the field holds and what was given, from OmegaConf's
    validation error under Hydra's "Error merging override"."""
    cause = e
    while cause is not None and getattr(cause, "full_key", None) is None:
        cause = cause.__cause__
    key = getattr(cause, "full_key", None)
    if not key:
        return None
    given = next((a.split("=", 1)[1] for a in overrides if a.split("=", 1)[0].lstrip("+~") == key), "?")
    text = str(cause).split("\n", 1)[0]
    if "is not a ListConfig" in text:
        return f"{key}={given}: {key} is a list; write {key}=[{given}] (several: {key}=[a,b])"
    for word, kind in (("Integer", "an integer"), ("Float", "a number"), ("valid bool", "true or false")):
        if word in text:
            return f"{key}={given}: {key} must be {kind}, got {given!r}"
    return f"{key}={given}: {text}"


def check_overrides(config_name: str, overrides: Sequence[str]) -> Any:
    """Compose and validate like the job will; returns the config, or raises ``ConfigError``
    with one clear message."""
    own = [a for a in overrides if not a.startswith("hydra.")]
    try:
        return compose(config_name, own)
    except _hydra_errors() as e:
        msg = (
            unknown_key_message(config_name, own) or _override_type_message(e, own) or f"invalid config: {e}"
        )
        if "mismatched input" in str(e) or "token recognition error" in str(e):
            msg += (
                "\nA value with '=', '&', ',' or spaces (a storage URI with a query, say) must be quoted "
                "for Hydra inside the shell's quotes: 'train.output_dir=\"s3://bucket/run?scheme=http&...\"'"
            )
        raise ConfigError(msg) from e


def log_dir_for(config_name: str, overrides: Sequence[str]) -> Path | None:
    """Where a config error's traceback goes: ``<train.output_dir>/logs`` of the command line's
    run (its own output dir, or the config's default), None if even that cannot be composed."""
    from omegaconf import OmegaConf

    from rlhf.storage import local_mirror

    keep = [a for a in overrides if a.split("=", 1)[0].lstrip("+~") in ("train.output_dir", "experiment")]
    try:  # only what decides the output dir: nothing else that could fail again
        return local_mirror(OmegaConf.select(compose_raw(config_name, keep), "train.output_dir")) / "logs"
    except Exception:  # noqa: BLE001 - no better place than the temp dir
        return None


def report_user_error(e: BaseException, log_dir: Path | None, with_type: bool = False) -> int:
    """Print ``e`` as one message (``with_type``: led by its class, for failures that are not a
    user's mistake) and write its traceback to ``log_dir/error.log``; returns the exit code."""
    log_dir = log_dir or Path(tempfile.gettempdir())
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        path = log_dir / "error.log"
        path.write_text("".join(traceback.format_exception(type(e), e, e.__traceback__)))
        where = f" (traceback: {path})"
    except OSError:
        where = ""
    msg = str(e).strip() or type(e).__name__
    if with_type:
        msg = f"{type(e).__name__}: {msg}"
    print(f"error: {msg}{where}", file=sys.stderr, flush=True)
    return USER_ERROR_EXIT


def _first_last(history: list[dict], key: str) -> str | None:
    vals = [h[key] for h in history if key in h]
    return f"{vals[0]:.4g} -> {vals[-1]:.4g}" if vals else None


def run_summary(history: list[dict], output_dir: str | Path, wall_s: float, resumed_after: int = 0) -> str:
    """The lines a finished run prints: what it did and where its results are. ``resumed_after``:
    the step this run continued from (its checkpoint); the steps before it ran earlier."""
    from rlhf.storage import Store, redact

    store = Store(output_dir)
    steps = max((int(h["step"]) for h in history if "step" in h), default=len(history))
    if resumed_after:
        lines = [
            f"done: {steps} steps, {steps - resumed_after} of them in this run (resumed after step {resumed_after}) in {wall_s:.0f} s"
        ]
    else:
        lines = [f"done: {steps} steps in {wall_s:.0f} s"]
    for label, keys in (
        ("reward (mean)", ("reward/mean",)),
        ("train loss", ("train/loss", "policy/loss")),
        ("eval accuracy", ("eval/accuracy", "eval/rewards/accuracy", "eval/scores/accuracy")),
        ("eval loss", ("eval/loss",)),
    ):
        found = next((v for k in keys if (v := _first_last(history, k))), None)
        if found:
            lines.append(f"{label}: {found}")
    for label, rel in (
        ("model", "final"),
        ("checkpoints", "checkpoints"),
        ("metrics", "metrics.jsonl"),
        ("logs", "logs"),
    ):
        if store.exists(rel):  # a path as the user gave it (relative stays relative)
            where = redact(store.uri(rel)) if store.remote else str(Path(output_dir) / rel)
            lines.append(f"{label}: {where}")
    return "\n".join(lines)


def run_job(run: Callable[[Any], list[dict]], cfg: Any) -> None:
    """``run(cfg)`` with preemption handling; a user error exits 2, any other failure prints one
    message and exits 1 (the traceback goes to ``<train.output_dir>/logs/error.log``), success
    prints the summary."""
    from rlhf.storage import local_mirror
    from rlhf.trainer.run_control import exit_on_preemption

    t0 = time.perf_counter()
    log_dir = local_mirror(cfg.train.output_dir) / "logs"
    resumed_after = _resume_step(cfg.train)
    handler = _driver_log(log_dir)
    try:
        history = exit_on_preemption(run, cfg)
    except USER_ERRORS as e:
        raise SystemExit(report_user_error(e, log_dir)) from None
    except Exception as e:  # noqa: BLE001 - a failure, not a mistake: one message, exit 1
        report_user_error(e, log_dir, with_type=True)
        raise SystemExit(1) from None
    finally:
        logging.getLogger("rlhf").removeHandler(handler)
        handler.close()
    wall = time.perf_counter() - t0
    print("\n" + run_summary(history or [], cfg.train.output_dir, wall, resumed_after), flush=True)


def _resume_step(train: Any) -> int:
    """The step a run of ``train`` (``TrainConfig``) continues from: its latest checkpoint's, 0 if none."""
    from rlhf.trainer.checkpoint import latest_checkpoint

    found = latest_checkpoint(train.output_dir) if train.resume != "false" else None
    name = str(found).rstrip("/").rpartition("/")[2] if found else ""
    return int(name[5:]) if name.startswith("step_") and name[5:].isdigit() else 0


def _driver_log(log_dir: Path) -> logging.Handler:
    """The driver's own log lines (INFO and up) in ``<output_dir>/logs/driver.log``, beside the
    workers' logs; a storage URI gets it with them at every checkpoint."""
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / "driver.log")
    handler.setLevel(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("rlhf").addHandler(handler)
    return handler


def _cfg_mode(argv: Sequence[str]) -> str | None:
    """The part Hydra's ``--cfg``/``-c`` would print (job, hydra, all), or None."""
    for i, a in enumerate(argv):
        if a in ("--cfg", "-c") and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--cfg="):
            return a.split("=", 1)[1]
    return None


def print_config(config_name: str, overrides: Sequence[str]) -> None:
    """``--cfg job``: the validated config as YAML, credentials in storage URIs masked."""
    from omegaconf import OmegaConf

    from rlhf.storage import redact

    check_overrides(config_name, overrides)  # the same validation as a run
    cfg = OmegaConf.to_container(compose_raw(config_name, list(overrides)), resolve=True)

    def mask(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: mask(x) for k, x in v.items()}
        if isinstance(v, list):
            return [mask(x) for x in v]
        return redact(v) if isinstance(v, str) and "://" in v else v

    print(OmegaConf.to_yaml(mask(cfg)), end="")


def main(config_name: str, run: Callable[[Any], list[dict]]) -> None:
    """The ``__main__`` of an entry point: check the command line, then run the Hydra job.

    ``--check``: validate the config and data and exit (``rlhf.check``, no Ray, no workers);
    ``--cfg job``: print the validated config (credentials masked) and exit; other ``-`` flags
    are Hydra's own (``--help``, ``-m``)."""
    import hydra

    from rlhf.envvars import quiet_driver

    quiet_driver()
    argv = sys.argv[1:]
    own = [a for a in argv if not a.startswith("-") and a not in ("job", "hydra", "all")]
    try:
        if "--check" in argv:
            from rlhf.check import run_check

            run_check(config_name, check_overrides(config_name, own))
            return
        if _cfg_mode(argv) == "job":
            print_config(config_name, own)
            return
        if not any(a.startswith("-") for a in argv):
            check_overrides(config_name, argv)
    except USER_ERRORS as e:
        raise SystemExit(report_user_error(e, log_dir_for(config_name, own))) from None

    @hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base=None)
    def job(dict_cfg: Any) -> None:
        try:
            cfg = to_object(dict_cfg)
        except ConfigError as e:
            raise SystemExit(report_user_error(e, log_dir_for(config_name, own))) from None
        run_job(run, cfg)

    job()
