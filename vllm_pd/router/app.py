"""The proxy's HTTP server: OpenAI routes, /v1/models, /health, /metrics, admin.

aiohttp serves and calls the backends (chosen by measurement, see
benchmarks/RESULTS.md "Proxy"). Handler cancellation is on, so a client
disconnect cancels the request's task, and with it whichever leg is running.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

import aiohttp
from aiohttp import web

from vllm_pd.router.admin import AdminApi
from vllm_pd.router.config import ProxyConfig
from vllm_pd.router.errors import ProxyError
from vllm_pd.router.health import HealthChecker
from vllm_pd.router.http_client import BackendClient
from vllm_pd.router.instance_pool import InstancePool
from vllm_pd.router.metrics import ProxyMetrics
from vllm_pd.router.pd_flow import PDFlow, ReleaseFn, default_release_remote_kv
from vllm_pd.router.policies import make_policy
from vllm_pd.router.request_body import CHAT, COMPLETIONS, TokenCounter, estimate_tokens, parse_body
from vllm_pd.router.supervisor import Supervisor

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ProxyServer:
    """Everything one proxy process holds; ``app`` is the aiohttp application."""

    def __init__(self, config: ProxyConfig, release_kv: ReleaseFn = default_release_remote_kv,
                 count_tokens: TokenCounter | None = None, run_health_checks: bool = True) -> None:
        self.config = config
        self.pool = InstancePool(config)
        self.metrics = ProxyMetrics(self.pool)
        self.count_tokens = count_tokens or _token_counter(config.tokenizer)
        self._release_kv = release_kv
        self._run_health_checks = run_health_checks
        self.client: BackendClient | None = None
        self.flow: PDFlow | None = None
        self.health: HealthChecker | None = None
        self.supervisor: Supervisor | None = None
        self.app = web.Application(client_max_size=config.max_body_bytes, middlewares=[self._errors])
        self.app.router.add_post(COMPLETIONS, self._completion)
        self.app.router.add_post(CHAT, self._completion)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/metrics", self._metrics)
        AdminApi(self.pool, config.admin_token, self._on_instance_added).register(self.app)
        self.app.on_startup.append(self._start)
        self.app.on_cleanup.append(self._stop)

    async def _start(self, app: web.Application) -> None:
        self.client = BackendClient(self.config.connect_timeout)
        self.flow = PDFlow(self.config, self.pool, self.client, self.metrics,
                           make_policy(self.config.prefill_policy), make_policy(self.config.decode_policy),
                           self._release_kv)
        self.health = HealthChecker(self.pool, self.client, self.config.health_interval, self.config.health_timeout)
        if self._run_health_checks:
            self.health.start()
        if self.config.supervisor:
            self.supervisor = Supervisor(self.pool, self.config.supervisor_interval,
                                         self.config.supervisor_ttft_slo, self.config.supervisor_tpot_slo)
            self.supervisor.start()

    async def _stop(self, app: web.Application) -> None:
        if self.supervisor:
            await self.supervisor.stop()
        if self.health:
            await self.health.stop()
        if self.flow:
            await self.flow.drain_background()
        if self.client:
            self.client.close()

    async def _on_instance_added(self) -> None:
        if self.health is not None:
            await self.health.check_all()

    # ----------------------------------------------------------------- routes
    @web.middleware
    async def _errors(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except ProxyError as e:
            return _error_response(e)
        except web.HTTPRequestEntityTooLarge:
            return _error_response(ProxyError(413, f"request body larger than {self.config.max_body_bytes} bytes",
                                              code="body_too_large"))
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return _error_response(ProxyError(e.status, e.reason, "invalid_request_error", code=str(e.status)))
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            raise
        except Exception:
            logger.exception("unexpected error on %s %s", request.method, request.path)
            return _error_response(ProxyError(500, "internal proxy error", "internal_error"))

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        t0 = time.monotonic()
        status = 500
        try:
            raw = await request.read()
            parsed = parse_body(raw, request.path, self.count_tokens)
            self._check_model(parsed.model)
            assert self.flow is not None
            resp = await self.flow.handle(parsed, request)
            status = resp.status
            return resp
        except ProxyError as e:
            status = e.status
            raise
        except asyncio.CancelledError:
            status = 499  # the client went away
            raise
        finally:
            self.metrics.requests.labels(request.path, str(status)).inc()
            self.metrics.request_seconds.labels(request.path).observe(time.monotonic() - t0)

    def _known_models(self) -> set[str]:
        names = set(self.config.model_names)
        for inst in self.pool.all():
            names.update(inst.models)
        return names

    def _check_model(self, model: str | None) -> None:
        known = self._known_models()
        if model is not None and known and model not in known:
            raise ProxyError(404, f"The model `{model}` does not exist.", "NotFoundError", "model",
                             "model_not_found")

    async def _models(self, request: web.Request) -> web.Response:
        data = [{"id": m, "object": "model", "owned_by": "vllm-pd"} for m in sorted(self._known_models())]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        ok = bool(self.pool.eligible("decode"))
        body = {"status": "ok" if ok else "no healthy decode instance",
                "prefill": len(self.pool.eligible("prefill")), "decode": len(self.pool.eligible("decode"))}
        return web.json_response(body, status=200 if ok else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")


def _error_response(e: ProxyError) -> web.Response:
    return web.Response(body=e.json_bytes(), status=e.status, content_type="application/json")


def _token_counter(tokenizer_dir: str | None) -> TokenCounter:
    if not tokenizer_dir:
        return estimate_tokens
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tokenizer_dir.rstrip('/')}/tokenizer.json")
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


async def serve(server: ProxyServer) -> web.AppRunner:
    """Start listening; the caller keeps the runner and calls ``cleanup()`` to stop."""
    runner = web.AppRunner(server.app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, server.config.host, server.config.port, backlog=2048)
    await site.start()
    logger.info("vllm-pd proxy listening on http://%s:%d", server.config.host, server.config.port)
    return runner
