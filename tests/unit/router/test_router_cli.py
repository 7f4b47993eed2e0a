"""The proxy's flags (merged with YAML) and `vllm-pd up` helpers."""

from __future__ import annotations

import argparse

import pytest

from vllm_pd.router.cli import command_proxy, command_up
from vllm_pd.router.cli.local_cluster import LocalServer, cpu_bindings
from vllm_pd.router.config import ConfigError
from vllm_pd.vllm_server import VllmServer, VllmServerSpec


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    command_proxy.add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_build_instances_and_override_yaml(tmp_path) -> None:
    f = tmp_path / "p.yaml"
    f.write_text("port: 9100\nkv_mode: pull\ninstances:\n  - {url: 'http://127.0.0.1:8101', role: prefill}\n")
    cfg = command_proxy.config_from_args(
        _args(
            "--config",
            str(f),
            "--kv-mode",
            "push",
            "--prefill",
            "http://127.0.0.1:8100",
            "--decode",
            "http://127.0.0.1:8200",
            "--decode-kv",
            "tcp://127.0.0.1:14600",
            "--both",
            "http://127.0.0.1:8300@tcp://127.0.0.1:14700",
            "--require-disagg",
        )
    )
    assert cfg.port == 9100 and cfg.kv_mode == "push" and cfg.require_disagg is True
    assert [(i.url, i.role, i.kv_endpoint) for i in cfg.instances] == [
        ("http://127.0.0.1:8101", "prefill", None),
        ("http://127.0.0.1:8100", "prefill", None),
        ("http://127.0.0.1:8200", "decode", "tcp://127.0.0.1:14600"),
        ("http://127.0.0.1:8300", "both", "tcp://127.0.0.1:14700"),
    ]


def test_flag_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="decode_kv"):
        command_proxy.config_from_args(
            _args("--decode", "http://a:1", "--decode", "http://a:2", "--decode-kv", "tcp://a:3")
        )
    with pytest.raises(ConfigError, match="prefill_timeout"):
        command_proxy.config_from_args(_args("--prefill-timeout", "0"))
    with pytest.raises(ConfigError, match="url"):
        command_proxy.config_from_args(_args("--decode", "localhost:8000"))
    assert command_proxy.run(_args("--decode", "nope")) == 2


def test_up_arguments_and_cpu_binding() -> None:
    p = argparse.ArgumentParser()
    command_up.add_arguments(p)
    a = p.parse_args(["--prefill", "2", "--decode", "1"])
    assert (a.prefill, a.decode, a.port) == (2, 1, 8000)
    assert cpu_bindings(2, [0, 1]) == ["0", "1"]
    assert cpu_bindings(3, [0, 1]) == ["0", "1", "0"]  # more servers than cores: share single cores
    assert cpu_bindings(2, list(range(8))) == ["0-3", "4-7"]
    assert command_up.run(p.parse_args(["--decode", "0"])) == 2
    # every server of `up` is on this machine: the same-host transport, whose endpoints say so
    assert a.transport == "shm" and p.parse_args(["--transport", "tcp"]).transport == "tcp"


def test_local_servers_advertise_their_transport_s_endpoints() -> None:
    spec = VllmServerSpec(model="m", port=8100, host="127.0.0.1")
    server = VllmServer(spec)
    assert LocalServer("d0", "decode", server, 14600, "shm").kv_endpoint == "shm://127.0.0.1:14600"
    assert LocalServer("d0", "decode", server, 14600).kv_endpoint == "tcp://127.0.0.1:14600"


def test_observability_and_drain_flags() -> None:
    cfg = command_proxy.config_from_args(
        _args("--otlp-endpoint", "http://collector:4317", "--request-log", "-", "--drain-grace", "7.5")
    )
    assert (cfg.otlp_endpoint, cfg.request_log, cfg.drain_grace) == ("http://collector:4317", "-", 7.5)
    assert command_proxy.config_from_args(_args()).drain_grace == 30.0
    with pytest.raises(ConfigError, match="drain_grace"):
        command_proxy.config_from_args(_args("--drain-grace", "-1"))


def test_resilience_flags_and_their_errors_name_the_key() -> None:
    cfg = command_proxy.config_from_args(
        _args(
            "--probe-after",
            "0.5",
            "--probe-timeout",
            "0.25",
            "--max-prefill-answer-bytes",
            "1000",
            "--max-decode-answer-bytes",
            "2000",
            "--max-sse-event-bytes",
            "3000",
            "--max-error-body-bytes",
            "400",
        )
    )
    assert (cfg.probe_after, cfg.probe_timeout) == (0.5, 0.25)
    assert (
        cfg.max_prefill_answer_bytes,
        cfg.max_decode_answer_bytes,
        cfg.max_sse_event_bytes,
        cfg.max_error_body_bytes,
    ) == (1000, 2000, 3000, 400)
    for flag, key in (
        ("--probe-after", "probe_after"),
        ("--probe-timeout", "probe_timeout"),
        ("--max-prefill-answer-bytes", "max_prefill_answer_bytes"),
        ("--max-decode-answer-bytes", "max_decode_answer_bytes"),
        ("--max-sse-event-bytes", "max_sse_event_bytes"),
        ("--max-error-body-bytes", "max_error_body_bytes"),
    ):
        with pytest.raises(ConfigError, match=key):
            command_proxy.config_from_args(_args(flag, "0"))
