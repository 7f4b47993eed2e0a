"""A bad connector setting stops vLLM at start-up with a message naming the key."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.support import e2e_cluster as ec
from vllm_pd.vllm_server import VllmServer

pytestmark = pytest.mark.e2e


def test_unknown_connector_key_stops_startup(small_model_dir: Path, tmp_path: Path) -> None:
    ktc = ec.connector_config("kv_producer", ec.free_port(), transprot="tcp")
    server = VllmServer(ec.server_spec(small_model_dir, "0-1", ktc), tmp_path / "vllm.log").start()
    try:
        deadline = time.monotonic() + 600
        while server.alive() and not server.healthy() and time.monotonic() < deadline:
            time.sleep(1)
        assert not server.healthy(), "vLLM started despite an unknown connector setting"
        assert not server.alive(), "vLLM neither failed nor started"
        log = (tmp_path / "vllm.log").read_text(errors="replace")
        assert "unknown key(s) 'transprot'" in log
    finally:
        server.stop()
