"""Worker log routing: INFO to the run's log file, the console keeps warnings and errors."""

from __future__ import annotations

import io
import json
import logging
import logging.config

from rlhf.workers.logs import route_worker_logs, vllm_logging_config


def test_vllm_logging_config_sends_info_to_the_file_only(tmp_path, monkeypatch):
    console = io.StringIO()
    monkeypatch.setattr("sys.stdout", console)
    log_file = tmp_path / "engine.log"
    # vLLM reads the config from a JSON file (VLLM_LOGGING_CONFIG_PATH): it must round-trip
    logging.config.dictConfig(json.loads(json.dumps(vllm_logging_config(log_file))))
    lg = logging.getLogger("vllm.engine")
    try:
        lg.info("engine ready")
        lg.warning("slow step")
        lg.warning("RotaryEmbedding: Failed to load weights")
        lg.warning("Gemma2Model: Failed to load weights")
        logging.getLogger("vllm.v1.worker.cpu_worker").warning(
            "CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it."
        )
        for h in logging.getLogger("vllm").handlers:
            h.flush()
        text = log_file.read_text()
        assert "engine ready" in text and "slow step" in text
        assert "slow step" in console.getvalue() and "engine ready" not in console.getvalue()
        assert "RotaryEmbedding" in text and "RotaryEmbedding" not in console.getvalue()
        for noise in ("Gemma2Model", "set_num_threads"):  # in the file, not on the console
            assert noise in text and noise not in console.getvalue()
    finally:
        for h in list(logging.getLogger("vllm").handlers):
            logging.getLogger("vllm").removeHandler(h)
            h.close()


def test_route_worker_logs_lowers_console_and_adds_the_file(tmp_path):
    ds = logging.getLogger("DeepSpeed")
    # Only the handler this test plays DeepSpeed's own with: an `import deepspeed` earlier in
    # this pytest process (peft -> accelerate imports it) left one on a closed capture stream.
    earlier = list(ds.handlers)
    for h in earlier:
        ds.removeHandler(h)
    stream = io.StringIO()
    own = logging.StreamHandler(stream)
    ds.addHandler(own)
    old_propagate, ds.propagate = ds.propagate, False
    ds.setLevel(logging.INFO)
    root = logging.getLogger()
    before = list(root.handlers)
    try:
        route_worker_logs(tmp_path / "logs" / "actor-0.log")
        ds.info("zero stage 2 initialised")
        ds.warning("grad overflow")
        for h in ds.handlers:
            h.flush()
        text = (tmp_path / "logs" / "actor-0.log").read_text()
        assert "zero stage 2 initialised" in text and "grad overflow" in text
        assert "grad overflow" in stream.getvalue() and "initialised" not in stream.getvalue()
        route_worker_logs(None)  # no dir: nothing changes
    finally:
        for h in [h for h in ds.handlers if h is not own] + [own]:
            ds.removeHandler(h)
        for h in earlier:
            ds.addHandler(h)
        for h in [h for h in root.handlers if h not in before]:
            root.removeHandler(h)
            h.close()
        ds.propagate = old_propagate
