"""The proxy's HTTP server: OpenAI routes, /v1/models, /health, /metrics, admin.

Served by http_server.py and calling the backends through http_client.py,
both lean asyncio Protocols with httptools parsers (chosen by measurement, see
docs/benchmarks/proxy.md). A client disconnect cancels the request's
task, and with it whichever leg is running.
"""

from __future__ import annotations

import asyncio
import logging
import time

from vllm_pd.router.backend.backend_url import BackendAddressPolicy, parse_networks
from vllm_pd.router.backend.http_client import BackendClient, tls_context
from vllm_pd.router.config import ProxyConfig
from vllm_pd.router.flow.admission import AdmissionGate
from vllm_pd.router.flow.pd_flow import PDFlow, ReleaseFn, default_release_remote_kv
from vllm_pd.router.http.client_auth import ClientAuth, bearer
from vllm_pd.router.http.errors import ProxyError
from vllm_pd.router.http.http_limits import HttpLimits
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, StreamResponse, json_response
from vllm_pd.router.http.http_server import Handler, HttpServer
from vllm_pd.router.observability.metrics import ProxyMetrics
from vllm_pd.router.observability.request_log import RequestLog
from vllm_pd.router.observability.tracer_choice import make_tracer
from vllm_pd.router.observability.tracing import Tracer
from vllm_pd.router.pool.health import HealthChecker
from vllm_pd.router.pool.instance_pool import InstancePool
from vllm_pd.router.pool.k8s_discovery import KubernetesDiscovery
from vllm_pd.router.pool.partition_watch import PartitionWatch
from vllm_pd.router.pool.stall_probe import StallProbe
from vllm_pd.router.pool.supervisor import Supervisor, supervisor_profile
from vllm_pd.router.request.request_body import CHAT, COMPLETIONS, TokenCounter, estimate_tokens, parse_body
from vllm_pd.router.routing.kv_routing import KvRouting
from vllm_pd.router.routing.policies import make_policy
from vllm_pd.router.server.admin import AdminApi

logger = logging.getLogger(__name__)


class ProxyServer:
    """Everything one proxy process holds; ``routes`` is what its HTTP server serves."""

    def __init__(
        self,
        config: ProxyConfig,
        release_kv: ReleaseFn = default_release_remote_kv,
        count_tokens: TokenCounter | None = None,
        run_health_checks: bool = True,
    ) -> None:
        self.config = config
        self.pool = InstancePool(config)
        self.metrics = ProxyMetrics(self.pool)
        # kv_aware tokenizes every prompt exactly off the event loop (KvRouting.annotate): counting it here
        # too would tokenize it twice, once on the loop (~10 ms at 33K tokens); the estimate stands in only
        # for prompts kv_aware cannot reproduce
        kv_aware = "kv_aware" in (config.prefill_policy, config.decode_policy)
        self.count_tokens = count_tokens or _token_counter(None if kv_aware else config.tokenizer)
        if release_kv is default_release_remote_kv and (config.secret is not None or config.kv_tls is not None):
            secret, tls = config.secret, config.kv_tls
            release_kv = lambda params: default_release_remote_kv(params, secret, tls)  # noqa: E731
        self._release_kv = release_kv
        self._run_health_checks = run_health_checks
        self.client: BackendClient | None = None
        self.flow: PDFlow | None = None
        self.kv_routing: KvRouting | None = None
        self.health: HealthChecker | None = None
        self.stall_probe: StallProbe | None = None
        self.supervisor: Supervisor | None = None
        self.discovery: KubernetesDiscovery | None = None
        self.tracer: Tracer | None = None
        self.request_log: RequestLog | None = None
        self.routes: dict[str, dict[str, Handler]] = {
            COMPLETIONS: {"POST": self._completion},
            CHAT: {"POST": self._completion},
            "/v1/models": {"GET": self._models},
            "/health": {"GET": self._health},
            "/metrics": {"GET": self._metrics},
        }
        AdminApi(
            self.pool,
            config.admin_token,
            self._on_instance_added,
            BackendAddressPolicy(parse_networks(config.backend_networks, "backend_networks")),
        ).register(self.routes)
        if config.api_key:
            ClientAuth(config.api_key).protect(self.routes)
        self.gate = (
            AdmissionGate(config.max_concurrent_requests, config.max_queued_requests)
            if config.max_concurrent_requests
            else None
        )
        if self.gate is not None:
            gate = self.gate
            self.metrics.queue_length = lambda: gate.waiting

    async def start(self) -> None:
        self.client = BackendClient(
            self.config.connect_timeout, tls_context(self.config.backend_ca_file, self.config.backend_tls_verify)
        )
        watch = PartitionWatch()  # checks find lost instances; the flow's legs on them move on
        self.tracer = make_tracer(self.config.otlp_endpoint)
        self.request_log = RequestLog(self.config.request_log) if self.config.request_log else None
        locations = None
        if "kv_aware" in (self.config.prefill_policy, self.config.decode_policy):
            self.kv_routing = KvRouting(self.config, self.pool)
            self.kv_routing.start()
            locations = self.kv_routing.locations
        weight = self.config.kv_load_weight
        self.flow = PDFlow(
            self.config,
            self.pool,
            self.client,
            self.metrics,
            make_policy(self.config.prefill_policy, locations, weight),
            make_policy(self.config.decode_policy, locations, weight),
            self._release_kv,
            self.tracer,
            self.request_log,
            watch,
            locations,
        )
        key = self.config.backend_api_key
        self.health = HealthChecker(
            self.pool,
            self.client,
            self.config.health_interval,
            self.config.health_timeout,
            headers=(("Authorization", bearer(key)),) if key else (),
            watch=watch,
        )
        if self._run_health_checks:
            self.health.start()
            self.stall_probe = StallProbe(
                watch, self.pool, self.client, self.health, self.config.probe_after, self.config.probe_timeout
            )
        if self.config.supervisor:
            self.supervisor = Supervisor(
                self.pool,
                self.config.supervisor_interval,
                self.config.supervisor_ttft_slo,
                self.config.supervisor_tpot_slo,
                supervisor_profile(self.config.supervisor_profile),
            )
            self.supervisor.start()
        if self.config.kubernetes is not None:
            self.discovery = KubernetesDiscovery(self.pool, self.config.kubernetes, on_added=self._on_instance_added)
            self.discovery.start()

    async def stop(self) -> None:
        if self.discovery:
            await self.discovery.stop()
        if self.supervisor:
            await self.supervisor.stop()
        if self.stall_probe:
            await self.stall_probe.stop()
        if self.health:
            await self.health.stop()
        if self.flow:
            await self.flow.drain_background()
        if self.client:
            self.client.close()
        if self.tracer:
            await self.tracer.shutdown()
        if self.request_log:
            self.request_log.close()
        if self.kv_routing:
            self.kv_routing.stop()

    async def _on_instance_added(self) -> None:
        if self.health is not None:
            await self.health.check_all()

    # ----------------------------------------------------------------- routes
    async def _completion(self, request: HttpRequest) -> HttpResponse | StreamResponse:
        t0 = time.monotonic()
        status = 500
        try:
            parsed = parse_body(request.body, request.path, self.count_tokens)
            self._check_model(parsed.model)
            if self.kv_routing is not None:
                await self.kv_routing.annotate(parsed)
            assert self.flow is not None
            if self.gate is None:
                resp = await self.flow.handle(parsed, request)
            else:
                await self.gate.enter()
                try:
                    resp = await self.flow.handle(parsed, request)
                finally:
                    self.gate.leave()
            status = resp.status
            return resp
        except ProxyError as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.metrics.count_request(request.path, status, time.monotonic() - t0)

    def _known_models(self) -> set[str]:
        names = set(self.config.model_names)
        for inst in self.pool.all():
            names.update(inst.models)
        return names

    def _check_model(self, model: str | None) -> None:
        known = self._known_models()
        if model is not None and known and model not in known:
            raise ProxyError(404, f"The model `{model}` does not exist.", "NotFoundError", "model", "model_not_found")

    async def _models(self, request: HttpRequest) -> HttpResponse:
        data = [{"id": m, "object": "model", "owned_by": "vllm-pd"} for m in sorted(self._known_models())]
        return json_response({"object": "list", "data": data})

    async def _health(self, request: HttpRequest) -> HttpResponse:
        ok = bool(self.pool.eligible("decode"))
        body = {
            "status": "ok" if ok else "no healthy decode instance",
            "prefill": len(self.pool.eligible("prefill")),
            "decode": len(self.pool.eligible("decode")),
        }
        return json_response(body, status=200 if ok else 503)

    async def _metrics(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse(self.metrics.render(), content_type="text/plain; charset=utf-8")


def _token_counter(tokenizer_dir: str | None) -> TokenCounter:
    if not tokenizer_dir:
        return estimate_tokens
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_dir.rstrip('/')}/tokenizer.json")
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


class RunningProxy:
    """A proxy that listens; ``cleanup()`` stops it."""

    def __init__(self, proxy: ProxyServer, http: HttpServer) -> None:
        self.proxy = proxy
        self.http = http

    async def cleanup(self) -> None:
        await self.http.cleanup()
        await self.proxy.stop()


async def serve(server: ProxyServer) -> RunningProxy:
    """Start listening; the caller keeps the result and calls ``cleanup()`` to stop."""
    await server.start()
    cfg = server.config
    limits = HttpLimits(cfg.max_header_bytes, cfg.max_headers, cfg.max_url_bytes, cfg.header_timeout, cfg.body_timeout)
    http = HttpServer(server.routes, cfg.max_body_bytes, limits)
    try:
        await http.start(server.config.host, server.config.port, backlog=2048)
    except BaseException:
        await server.stop()
        raise
    logger.info("vllm-pd proxy listening on http://%s:%d", server.config.host, server.config.port)
    return RunningProxy(server, http)
