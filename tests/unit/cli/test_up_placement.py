"""`vllm-pd up`'s choices before any server starts: GPUs per server, the served model name,
vLLM arguments passed through, and the command each server runs. `up` itself, end to end,
is tests/e2e/test_up_e2e.py."""

from __future__ import annotations

import argparse
import os
import sys
import types
from pathlib import Path

import pytest

from vllm_pd.router.cli import command_up, local_cluster
from vllm_pd.router.cli.local_cluster import LocalCluster, gpu_bindings, visible_gpus
from vllm_pd.vllm_server import VllmServer, VllmServerSpec


def _parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    command_up.add_arguments(p)
    return p.parse_args(list(argv))


def test_each_server_gets_gpus_of_its_own_in_order() -> None:
    gpus = ["0", "1", "2", "3"]
    assert gpu_bindings(3, 0, gpus) == [None, None, None]
    assert gpu_bindings(2, 1, gpus) == ["0", "1"]
    assert gpu_bindings(2, 2, gpus) == ["0,1", "2,3"]
    assert gpu_bindings(2, 1, ["4", "6"]) == ["4", "6"]  # the machine's ids, as CUDA_VISIBLE_DEVICES gave them
    with pytest.raises(ValueError, match="needs 6 GPUs, 4 visible"):
        gpu_bindings(3, 2, gpus)
    with pytest.raises(ValueError, match="gpus_per_instance"):
        gpu_bindings(1, -1, gpus)


def _fake_torch(monkeypatch: pytest.MonkeyPatch, available: bool, count: int) -> None:
    # stands in for a CUDA torch: this machine has no GPU
    cuda = types.SimpleNamespace(is_available=lambda: available, device_count=lambda: count)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))


def test_visible_gpus_follow_torch_and_the_inherited_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _fake_torch(monkeypatch, available=False, count=0)
    assert visible_gpus() == []
    _fake_torch(monkeypatch, available=True, count=2)
    assert visible_gpus() == ["0", "1"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5, 7")
    assert visible_gpus() == ["5", "7"]


def test_no_gpus_on_this_cpu_torch() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert visible_gpus() == []


def test_cluster_hands_each_server_its_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # no process is started: the GPUs the servers would use do not exist here
    monkeypatch.setattr(VllmServer, "start", lambda self: self)
    cluster = LocalCluster(
        model="m",
        n_prefill=1,
        n_decode=2,
        log_dir=tmp_path,
        gpus_per_instance=1,
        gpus=["0", "1", "2"],
        served_model_name="short",
        serve_cli=True,
        extra_args=["--enable-prefix-caching"],
    )
    cluster.start()
    specs = [s.server.spec for s in cluster.servers]
    assert [s.gpus for s in specs] == ["0", "1", "2"]
    assert [s.environment()["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0", "1", "2"]
    cmd = specs[0].command()
    assert cmd[cmd.index("serve") - 1].endswith("vllm") and cmd[cmd.index("serve") + 1] == "m"
    assert cmd[cmd.index("--served-model-name") + 1] == "short"
    assert cmd[-1] == "--enable-prefix-caching"  # passed through last
    with pytest.raises(ValueError, match="needs 3 GPUs, 2 visible"):
        LocalCluster(model="m", n_prefill=1, n_decode=2, log_dir=tmp_path, gpus_per_instance=1, gpus=["0", "1"]).start()


def test_the_module_launcher_stays_the_default() -> None:
    spec = VllmServerSpec(model="m", port=8100)
    cmd = spec.command()
    assert cmd[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    # no GPUs assigned: the server sees what this process sees
    assert spec.environment().get("CUDA_VISIBLE_DEVICES") == os.environ.get("CUDA_VISIBLE_DEVICES")


def test_served_model_name_is_short_by_default(tmp_path: Path) -> None:
    assert command_up.served_name(None, None) == command_up.SMALL_MODEL_NAME
    assert command_up.served_name(str(tmp_path), None) == tmp_path.name
    assert command_up.served_name("Qwen/Qwen3-0.6B", None) == "Qwen/Qwen3-0.6B"  # an HF id is short already
    assert command_up.served_name(str(tmp_path), "mine") == "mine"


def test_vllm_arguments_after_the_separator_pass_through_but_not_ups_own() -> None:
    a = _parse("--prefill", "1", "--", "--enable-prefix-caching", "--max-num-batched-tokens", "512")
    assert a.vllm_args == ["--enable-prefix-caching", "--max-num-batched-tokens", "512"]
    assert _parse().vllm_args == [] and _parse().gpus_per_instance is None
    command_up.check_vllm_args(a.vllm_args)
    for bad, hint in (
        ("--port", "free port"),
        ("--kv-transfer-config={}", "--connector"),
        ("--served-model-name", "--served-model-name"),
    ):
        with pytest.raises(ValueError, match=hint):
            command_up.check_vllm_args([bad, "x"])
    assert command_up.run(_parse("--", "--port", "9")) == 2


def test_more_gpus_asked_than_visible_stops_before_any_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local_cluster, "visible_gpus", lambda: ["0"])
    assert command_up.run(_parse("--gpus-per-instance", "1")) == 2  # 2 servers, 1 GPU


def test_kv_aware_turns_on_kv_events_and_gives_the_proxy_the_tokenizer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # no process is started: only what `up` hands the servers and the proxy is checked
    from vllm_pd.router.cli import command_proxy

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    for name, value in (
        ("start", lambda self: self),
        ("alive", lambda self: True),
        ("healthy", lambda self: True),
        ("stop", lambda self: None),
    ):
        monkeypatch.setattr(VllmServer, name, value)
    configs: list = []

    async def serve(cfg: object) -> None:
        configs.append(cfg)

    monkeypatch.setattr(command_proxy, "serve_until_signal", serve)
    monkeypatch.setattr(command_proxy, "install_uvloop", lambda: None)
    monkeypatch.setattr(command_up.signal, "signal", lambda *a: None)  # keep pytest's own SIGTERM handler
    argv = ("--model", str(model), "--prefill", "2", "--log-dir", str(tmp_path / "logs"), "--policy", "kv_aware")
    assert command_up.run(_parse(*argv)) == 0
    (cfg,) = configs
    assert (cfg.prefill_policy, cfg.decode_policy, cfg.tokenizer) == ("kv_aware", "kv_aware", str(model))
    assert len(cfg.instances) == 3 and all(ic.kv_events and ic.kv_events.startswith("tcp://") for ic in cfg.instances)

    assert command_up.run(_parse(*argv[:-2])) == 0  # the default policy: no events, no tokenizer
    assert configs[1].prefill_policy == "prefix_aware" and configs[1].tokenizer is None
    assert not any(ic.kv_events for ic in configs[1].instances)


def test_kv_aware_needs_a_local_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(command_up.signal, "signal", lambda *a: None)  # keep pytest's own SIGTERM handler
    assert command_up.routing_settings("round_robin", "org/some-hf-model")["tokenizer"] is None
    with pytest.raises(ValueError, match="--policy kv_aware needs the model as a local folder"):
        command_up.routing_settings("kv_aware", "org/some-hf-model")
    assert command_up.run(_parse("--model", "org/some-hf-model", "--policy", "kv_aware")) == 2


def test_store_gives_every_server_a_store_and_the_proxy_the_master(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # no vLLM server is started (only what `up` hands them is checked); the store master is a real process
    from vllm_pd.router.cli import command_proxy

    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    specs: list[VllmServerSpec] = []

    def start(self: VllmServer) -> VllmServer:
        specs.append(self.spec)
        return self

    for name, value in (
        ("start", start),
        ("alive", lambda self: True),
        ("healthy", lambda self: True),
        ("stop", lambda self: None),
    ):
        monkeypatch.setattr(VllmServer, name, value)
    configs: list = []
    masters: list = []
    spawn = command_up._start_store_master

    def recording_spawn(host: str, secret_file: str | None) -> tuple:
        masters.append(spawn(host, secret_file))
        assert masters[-1][0].poll() is None  # running while the servers start
        return masters[-1]

    async def serve(cfg: object) -> None:
        configs.append(cfg)

    monkeypatch.setattr(command_up, "_start_store_master", recording_spawn)
    monkeypatch.setattr(command_proxy, "serve_until_signal", serve)
    monkeypatch.setattr(command_proxy, "install_uvloop", lambda: None)
    monkeypatch.setattr(command_up.signal, "signal", lambda *a: None)  # keep pytest's own SIGTERM handler
    argv = ["--model", str(model), "--log-dir", str(tmp_path / "logs"), "--store", "64m", "--policy", "kv_aware"]
    assert command_up.run(_parse(*argv)) == 0
    ((proc, address),) = masters
    assert proc.poll() is not None  # stopped with the servers
    for spec in specs:
        store = spec.kv_transfer_config["kv_connector_extra_config"]["store"]
        assert store == {"cpu_bytes": "64m", "master": address, "instance_url": f"http://127.0.0.1:{spec.port}"}
    # one deployment secret: every server, the proxy and the master (which its probe proved) have it
    secrets = {spec.kv_transfer_config["kv_connector_extra_config"]["secret_file"] for spec in specs}
    assert secrets == {configs[0].secret_file} and configs[0].secret is not None
    assert configs[0].store_master == address
    assert command_up.run(_parse(*argv[:-2])) == 0  # another policy: the stores, but the proxy does not read them
    assert configs[1].store_master is None and len(masters) == 2


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--store", "lots"], "--store: not a size"),
        (["--store", "0"], "--store: must be > 0"),
        (["--store", "1g", "--connector", "none"], "--store needs the KV connector"),
    ],
)
def test_a_bad_store_flag_stops_before_any_server(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(command_up.signal, "signal", lambda *a: None)
    monkeypatch.setattr(VllmServer, "start", lambda self: pytest.fail("a server was started"))
    assert command_up.run(_parse("--model", str(tmp_path), *argv)) == 2
    assert message in capsys.readouterr().err


def test_a_running_cluster_is_stopped_also_when_its_start_fails(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # no process is started: a server that dies during start-up is played by alive() -> False
    stopped: list[str] = []
    monkeypatch.setattr(VllmServer, "start", lambda self: self)
    monkeypatch.setattr(VllmServer, "alive", lambda self: False)
    monkeypatch.setattr(VllmServer, "log_tail", lambda self: "")
    monkeypatch.setattr(VllmServer, "stop", lambda self: stopped.append(self.url))
    cluster = LocalCluster(model="m", n_prefill=1, n_decode=1, log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="exited during start-up"):
        with cluster.running(5):
            pytest.fail("the block ran without healthy servers")
    assert len(stopped) == 2
