"""Worker log routing: library INFO lines to a file in the run's output dir, the console (which
Ray forwards to the driver) keeps warnings and errors only."""

from __future__ import annotations

import logging
from pathlib import Path

# Loggers with handlers of their own (they do not propagate to the root logger) and the root.
_OWN_HANDLERS = ("vllm", "DeepSpeed")


def route_worker_logs(log_file: str | Path | None) -> None:
    """Send INFO+ of vLLM, DeepSpeed and everything reaching the root logger to ``log_file``;
    lower their console handlers to WARNING. ``None`` leaves logging as it is."""
    if not log_file:
        return
    path = Path(log_file)
    path.parent.mkdir(parents=True, exist_ok=True)
    fh = logging.FileHandler(path)
    fh.setLevel(logging.INFO)
    fh.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in (*_OWN_HANDLERS, ""):
        lg = logging.getLogger(name)
        for h in lg.handlers:
            if isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler):
                h.setLevel(logging.WARNING)
        if name == "" or not lg.propagate:
            lg.addHandler(fh)
    root = logging.getLogger()
    if root.level > logging.INFO or root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    if not any(
        isinstance(h, logging.StreamHandler) and not isinstance(h, logging.FileHandler) for h in root.handlers
    ):
        console = logging.StreamHandler()
        console.setLevel(logging.WARNING)
        root.addHandler(console)


# Engine warnings with nothing for the user to do: they go to the engine's log file only.
# Real warnings (and everything else) still reach the console.
ENGINE_NOISE = (
    # vLLM 0.32's layerwise reload warns at every weight sync that the rotary embedding (and, for
    # Gemma2, the model wrapper) has no weights to load: they have none (the cos/sin cache is
    # derived, the wrapper's weights belong to its layers). Greedy output after a sync equals HF
    # generate on the same weights (tests/workers/test_rollout.py), and every step's
    # rollout/logprob_gap metric (engine vs trainer logprobs, ~1e-7 when the sync is right)
    # checks it on the run's own samples.
    "RotaryEmbedding: Failed to load weights",
    "Gemma2Model: Failed to load weights",
    # CPU engine start-up: settings we chose (eager mode, no chunked prefill, an engine seed,
    # in-process engine core), optional libraries of vLLM's CPU wheel (Triton CPU, tcmalloc,
    # iomp), and the worker refusing set_num_threads after its own thread binding.
    "The global random seed is set to",
    "does not officially support disabling chunked prefill",
    "Enforce eager set",
    "Inductor compilation was disabled",
    "Triton is not installed",
    "Triton is installed, but doesn't include CPU backend",
    "Model Runner V2 requires Triton",
    "is not found in LD_PRELOAD",
    "doesn't allow to use `torch.set_num_threads`",
    # ContinuousBatcher hands LLMEngine.add_request token prompts, as LLM.generate did before 0.32;
    # vLLM 0.32 announces a future renderer API for it
    "Passing raw prompts to InputProcessor is deprecated",
    # our adapter directories carry no tokenizer: the base model's is the one in use
    "different tokenizers for different LoRAs",
    # vLLM's CPU platform notes a dtype choice for mamba layers, which our models do not have
    "Reset SSM cache type",
)


class DropHarmless(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(s in record.getMessage() for s in ENGINE_NOISE)


def vllm_logging_config(log_file: str | Path) -> dict:
    """A ``logging.config.dictConfig`` for vLLM (its ``VLLM_LOGGING_CONFIG_PATH``): INFO to
    ``log_file``, warnings and errors to the console. vLLM applies it when the engine starts,
    replacing its default console-at-INFO setup."""
    fmt = {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"plain": fmt},
        "filters": {"harmless": {"()": f"{__name__}.DropHarmless"}},  # JSON-able: vLLM reads a file
        "handlers": {
            "console": {
                "class": "logging.StreamHandler",
                "level": "WARNING",
                "formatter": "plain",
                "stream": "ext://sys.stdout",
                "filters": ["harmless"],
            },
            "file": {
                "class": "logging.FileHandler",
                "level": "INFO",
                "formatter": "plain",
                "filename": str(log_file),
            },
        },
        "loggers": {"vllm": {"handlers": ["console", "file"], "level": "INFO", "propagate": False}},
    }
