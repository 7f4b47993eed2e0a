"""End-to-end: the proxy in front of real vLLM servers, driven by the official `openai` client.

One set of three servers - p0 (kv_producer), b0 (kv_both), d0 (kv_consumer) -
serves every test in this module; each test builds a cheap proxy over the
roles it needs: 2P1D = {p0, b0} -> d0, 1P2D = p0 -> {b0, d0}. The reference
for "same output as a plain instance" is a direct request to one of the
servers without kv_transfer_params: the connector stays out of it, so it is
plain vLLM computing prompt and output itself.
With our connector on main the servers run PDConnector (tcp transport) and
the tests also prove no KV is left held (vLLM's /metrics). Without it
(VLLM_PD_E2E_CONNECTOR=none, or before the connector lands) the servers are
plain vLLM: prefill answers without kv_transfer_params and decode recomputes,
which still checks the proxy's wire compatibility; the KV tests then skip.
The fault tests run last because they kill servers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.router.config import InstanceConfig, ProxyConfig
from vllm_pd.router.server.app import ProxyServer, serve
from vllm_pd.shm_leftovers import group_members, used_shm
from vllm_pd.vllm_server import free_port

pytestmark = pytest.mark.e2e


class _LazyOpenAI:
    """`import openai` takes seconds; only the e2e tests pay for it, not their collection."""

    def __getattr__(self, name: str) -> Any:
        module = pytest.importorskip("openai")
        return getattr(module, name)


openai = _LazyOpenAI()


def _model_dir() -> str:
    if os.environ.get("VLLM_PD_TEST_MODEL"):
        return os.environ["VLLM_PD_TEST_MODEL"]
    try:
        from vllm_pd.small_model import ensure_default_model
    except ImportError:
        pytest.skip("no test model: vllm_pd.small_model not available and VLLM_PD_TEST_MODEL unset")
    return str(ensure_default_model())


def _connector_mode() -> bool:
    if os.environ.get("VLLM_PD_E2E_CONNECTOR") == "none":
        return False
    return importlib.util.find_spec("vllm_pd.connector.connector") is not None


class ProxyThread:
    """The proxy on its own event loop in a thread (the openai client is synchronous)."""

    def __init__(self, instances: list[InstanceConfig], **kw: Any) -> None:
        self.config = ProxyConfig(port=free_port(), instances=instances, health_interval=0.5, **kw)
        self.url = f"http://127.0.0.1:{self.config.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self.server = ProxyServer(self.config)
        self.runner = self._loop.run_until_complete(serve(self.server))
        self._loop.run_until_complete(self.server.health.check_all())
        self._ready.set()
        self._loop.run_forever()

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, **kw)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    # a short lease so KV that nobody releases explicitly is provably freed within the test
    c = LocalCluster(
        model=_model_dir(),
        n_prefill=1,
        n_decode=1,
        n_both=1,
        max_model_len=1024,
        connector_extra={"lease_s": 15.0},
        connector=None if not _connector_mode() else "PDConnector",
    )
    with c.running(600):
        yield c


def _as(cluster: LocalCluster, **roles: str) -> list[InstanceConfig]:
    """Instance configs for the named servers in the given roles, e.g. _as(c, p0="prefill", b0="decode")."""
    out = []
    for name, role in roles.items():
        ic = next(s.instance_config() for s in cluster.servers if s.name == name)
        out.append(InstanceConfig(ic.url, role, ic.kv_endpoint if role != "prefill" else None))
    return out


def _direct(cluster: LocalCluster, name: str) -> openai.OpenAI:
    url = next(s.server.url for s in cluster.servers if s.name == name)
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def _kv_usage(cluster: LocalCluster) -> dict[str, float]:
    out = {}
    for s in cluster.servers:
        if not s.server.alive():
            continue
        text = urllib.request.urlopen(s.server.url + "/metrics", timeout=5).read().decode()
        vals = [float(v) for v in re.findall(r"^vllm:kv_cache_usage_perc\{[^}]*\} (\S+)$", text, re.M)]
        # the connector's gauges: KV held for another instance, loads in progress
        held = [
            float(v)
            for v in re.findall(r"^vllm:pd_(?:held_transfers|loading_requests)(?:\{[^}]*\})? (\S+)$", text, re.M)
        ]
        out[s.name] = sum(vals) + sum(held)
    return out


def _assert_no_kv_held(cluster: LocalCluster, timeout: float = 75.0) -> None:
    """Every live server's KV usage and connector gauges drop to 0 (leases/timeouts are <= 30 s,
    the margin is for a loaded 2-core machine; a leak stays forever)."""
    if not _connector_mode():
        return
    deadline = time.monotonic() + timeout
    while True:
        usage = _kv_usage(cluster)
        if all(v == 0 for v in usage.values()):
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV still held after {timeout}s: {usage}\n{_pd_metric_lines(cluster)}")
        time.sleep(0.5)


def _pd_metric_lines(cluster: LocalCluster) -> str:
    lines = []
    for s in cluster.servers:
        if s.server.alive():
            text = urllib.request.urlopen(s.server.url + "/metrics", timeout=5).read().decode()
            lines += [
                f"{s.name}: {ln}" for ln in text.splitlines() if ln.startswith(("vllm:pd_", "vllm:kv_cache_usage_perc"))
            ]
    return "\n".join(lines)


PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "def fibonacci(n):\n    " * 8,
]


def test_completions_2p1d_equal_plain_instance(cluster: LocalCluster) -> None:
    proxy = ProxyThread(_as(cluster, p0="prefill", b0="prefill", d0="decode"), prefill_policy="round_robin")
    try:
        client = proxy.client()
        model = cluster.model
        for prompt in PROMPTS:
            via = client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            ref = _direct(cluster, "b0").completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0)
            assert via.choices[0].text == ref.choices[0].text
            assert via.usage.prompt_tokens == ref.usage.prompt_tokens
            assert via.usage.completion_tokens == 12
        if _connector_mode():
            assert proxy.server.metrics.fallbacks.labels("no_kv_params")._value.get() == 0
        _assert_no_kv_held(cluster)
    finally:
        proxy.close()


def test_pull_mode_equal_plain_instance(cluster: LocalCluster) -> None:
    proxy = ProxyThread(_as(cluster, p0="prefill", d0="decode"), kv_mode="pull")
    try:
        via = proxy.client().completions.create(model=cluster.model, prompt=PROMPTS[1], max_tokens=12, temperature=0)
        ref = _direct(cluster, "b0").completions.create(
            model=cluster.model, prompt=PROMPTS[1], max_tokens=12, temperature=0
        )
        assert via.choices[0].text == ref.choices[0].text
        _assert_no_kv_held(cluster)
    finally:
        proxy.close()


def test_chat_streaming_1p2d_equal_plain_instance(cluster: LocalCluster) -> None:
    proxy = ProxyThread(_as(cluster, p0="prefill", b0="decode", d0="decode"), decode_policy="round_robin")
    try:
        client = proxy.client()
        messages = [{"role": "user", "content": "Write a short poem about the sea."}]
        ref = _direct(cluster, "p0").chat.completions.create(
            model=cluster.model, messages=messages, max_tokens=10, temperature=0
        )
        for _ in range(2):  # both decode instances
            stream = client.chat.completions.create(
                model=cluster.model,
                messages=messages,
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = list(stream)
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text == ref.choices[0].message.content
            assert chunks[-1].usage.prompt_tokens == ref.usage.prompt_tokens
            assert chunks[-1].usage.completion_tokens == 10
        nonstream = client.chat.completions.create(model=cluster.model, messages=messages, max_tokens=10, temperature=0)
        assert nonstream.choices[0].message.content == ref.choices[0].message.content
        # streamed completions too, with logprobs passed through
        s = client.completions.create(
            model=cluster.model, prompt=PROMPTS[1], max_tokens=6, temperature=0, stream=True, logprobs=1
        )
        assert sum(len(c.choices[0].logprobs.tokens) for c in s if c.choices) == 6
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        _assert_no_kv_held(cluster)
    finally:
        proxy.close()


def test_client_disconnect_mid_stream_releases_everything(cluster: LocalCluster) -> None:
    proxy = ProxyThread(_as(cluster, p0="prefill", d0="decode"))
    try:
        client = proxy.client()
        for _ in range(3):
            stream = client.completions.create(
                model=cluster.model,
                prompt=PROMPTS[2],
                max_tokens=400,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for i, _chunk in enumerate(stream):
                if i == 3:
                    break
            stream.close()
        deadline = time.monotonic() + 10
        while any(i.load for i in proxy.server.pool.all()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(i.load == 0 for i in proxy.server.pool.all())
        assert proxy.server.metrics.disconnects.labels("stream")._value.get() >= 1
        _assert_no_kv_held(cluster)
    finally:
        proxy.close()


def _proxy_process(instances: list[InstanceConfig], *flags: str) -> tuple[subprocess.Popen, str]:
    """`vllm-pd proxy` as its own process (signals reach it as in production)."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "vllm_pd.router.cli.command_proxy",
        "--port",
        str(port),
        "--log-level",
        "INFO",
        "--health-interval",
        "0.5",
        *flags,
    ]
    for ic in instances:
        argv += [f"--{ic.role}", ic.url + (f"@{ic.kv_endpoint}" if ic.kv_endpoint else "")]
    proc = subprocess.Popen(argv)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return proc, url
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise AssertionError("the proxy process did not become healthy")
        time.sleep(0.2)


def _sigterm_during_stream(cluster: LocalCluster, max_tokens: int, grace: float) -> tuple[Any, float]:
    """A proxy process streams ``max_tokens``; SIGTERM once the first chunk is in. Returns (the stream's
    completion tokens, or the exception that cut it; seconds from SIGTERM to the stream's end)."""
    proc, url = _proxy_process(_as(cluster, p0="prefill", d0="decode"), "--drain-grace", str(grace))
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        s = client.completions.create(
            model=cluster.model,
            prompt=PROMPTS[1],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
        )
        chunks = iter(s)
        usage = next(chunks).usage
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        result: Any
        try:
            for chunk in chunks:
                usage = chunk.usage or usage
            result = usage.completion_tokens if usage else 0
        except Exception as e:  # cut by the drain
            result = e
        took = time.monotonic() - t_term
        with pytest.raises(OSError):  # no longer accepting
            urllib.request.urlopen(url + "/health", timeout=2)
        assert proc.wait(grace + 60) == 0
        return result, took
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_drains_finishes_in_flight_cancels_the_rest(cluster: LocalCluster) -> None:
    # in flight at SIGTERM, done within the grace period: all of it comes through
    tokens, _ = _sigterm_during_stream(cluster, max_tokens=200, grace=60.0)
    assert tokens == 200
    # past the grace period (1000 tokens take seconds even on a fast decode): cut, both legs cancelled,
    # and nothing left held on any server
    cut, took = _sigterm_during_stream(cluster, max_tokens=1000, grace=0.3)
    assert isinstance(cut, Exception) or cut < 1000, cut
    assert took < 20
    _assert_no_kv_held(cluster)


def test_kill_prefill_during_load_every_request_succeeds(cluster: LocalCluster) -> None:
    proxy = ProxyThread(
        _as(cluster, p0="prefill", b0="prefill", d0="decode"),
        prefill_policy="round_robin",
        decode_policy="least_outstanding",
    )
    try:
        client = proxy.client(timeout=120)
        done = []

        def one(i: int) -> str:
            r = client.completions.create(
                model=cluster.model, prompt=f"Request {i}: " + PROMPTS[i % 3], max_tokens=4, temperature=0
            )
            done.append(i)
            return r.choices[0].text

        victim = next(s for s in cluster.servers if s.name == "b0")
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(one, i) for i in range(200)]
            while len(done) < 40:
                time.sleep(0.05)
            victim.server.kill()
            results = [f.result() for f in futures]  # raises if any request failed
        assert len(results) == 200 and all(isinstance(r, str) for r in results)
        _assert_no_kv_held(cluster)
    finally:
        proxy.close()


def test_kill_only_decode_gives_clean_errors_no_hang(cluster: LocalCluster) -> None:
    proxy = ProxyThread(_as(cluster, p0="prefill", d0="decode"))
    try:
        client = proxy.client(timeout=60)
        assert client.completions.create(model=cluster.model, prompt="hi", max_tokens=2).choices
        d0 = next(s for s in cluster.servers if s.name == "d0").server
        queues = {p for p in used_shm(group_members(d0.pid)) if "/psm_" in p}  # vLLM's shm_broadcast
        assert queues
        d0.kill()
        assert not [p for p in queues if os.path.exists(p)], "the dead server's queues stayed in /dev/shm"
        for stream in (False, True):
            t0 = time.monotonic()
            with pytest.raises((openai.APIStatusError, openai.APIConnectionError)) as e:
                r = client.completions.create(model=cluster.model, prompt=PROMPTS[0], max_tokens=4, stream=stream)
                if stream:
                    list(r)
            assert time.monotonic() - t0 < 20
            if isinstance(e.value, openai.APIStatusError):
                assert e.value.status_code in (502, 503)
        _assert_no_kv_held(cluster)
    finally:
        proxy.close()
