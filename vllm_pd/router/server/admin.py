"""Admin API: list, add, remove, drain and re-role instances, behind a bearer token.

Without a configured token the admin API is off (every call answers 403), so
an exposed proxy is never reconfigurable by accident.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable

from vllm_pd.router.backend.backend_url import BackendAddressPolicy
from vllm_pd.router.config import ConfigError, InstanceConfig
from vllm_pd.router.http.errors import ProxyError, bad_request
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, json_response
from vllm_pd.router.http.http_server import Handler
from vllm_pd.router.pool.instance_pool import InstancePool


class AdminApi:
    def __init__(
        self,
        pool: InstancePool,
        token: str | None,
        on_added: Callable[[], Awaitable[None]] | None = None,
        addresses: BackendAddressPolicy | None = None,
    ) -> None:
        self._pool = pool
        self._token = token
        self._on_added = on_added
        self._addresses = addresses or BackendAddressPolicy([])

    def register(self, routes: dict[str, dict[str, Handler]]) -> None:
        routes["/admin/instances"] = {"GET": self._list, "POST": self._add, "DELETE": self._remove}
        routes["/admin/instances/drain"] = {"POST": self._drain}
        routes["/admin/instances/undrain"] = {"POST": self._undrain}
        routes["/admin/instances/role"] = {"POST": self._role}

    def _authorize(self, request: HttpRequest) -> None:
        if not self._token:
            raise ProxyError(
                403,
                "admin API disabled (start the proxy with --admin-token)",
                "permission_error",
                code="admin_disabled",
            )
        header = request.headers.get("authorization", "")
        given = header[7:] if header.startswith("Bearer ") else ""
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            raise ProxyError(401, "missing or wrong admin token", "authentication_error", code="invalid_token")

    async def _json(self, request: HttpRequest) -> dict:
        try:
            data = json.loads(request.body)
        except ValueError as e:
            raise bad_request(f"body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise bad_request("body nests too deep", code="invalid_json") from None
        if not isinstance(data, dict):
            raise bad_request("body must be a JSON object", code="invalid_json")
        return data

    def _url(self, data: dict) -> str:
        url = data.get("url")
        if not isinstance(url, str):
            raise bad_request("'url' must be a string", "url", "invalid_type")
        try:
            self._pool.get(url)
        except KeyError:
            raise ProxyError(404, f"no instance {url}", "NotFoundError", "url", "instance_not_found") from None
        return url

    async def _list(self, request: HttpRequest) -> HttpResponse:
        self._authorize(request)
        return json_response({"instances": [i.describe() for i in self._pool.all()]})

    async def _add(self, request: HttpRequest) -> HttpResponse:
        self._authorize(request)
        data = await self._json(request)
        unknown = set(data) - {"url", "role", "kv_endpoint"}
        if unknown:
            raise bad_request(f"unknown key {sorted(unknown)[0]!r}", sorted(unknown)[0], "unknown_key")
        try:
            ic = InstanceConfig(  # InstanceConfig checks the client's values: they may be of any type
                url=data.get("url"),  # type: ignore[arg-type]
                role=data.get("role"),  # type: ignore[arg-type]
                kv_endpoint=data.get("kv_endpoint"),
            )
            # where the proxy (and prefill, pushing KV) would connect: never an arbitrary address
            await self._addresses.check(ic.url, "url")
            if ic.kv_endpoint is not None:
                await self._addresses.check(ic.kv_endpoint, "kv_endpoint")
            inst = self._pool.add(ic)
        except ValueError as e:  # (ConfigError is one) the message names the key
            raise bad_request(str(e), str(e).split(":")[0], "invalid_value") from None
        if self._on_added is not None:
            await self._on_added()
        return json_response(inst.describe(), status=201)

    async def _remove(self, request: HttpRequest) -> HttpResponse:
        self._authorize(request)
        url = self._url({"url": request.query.get("url")} if "url" in request.query else await self._json(request))
        return json_response(self._pool.remove(url).describe())

    async def _drain(self, request: HttpRequest) -> HttpResponse:
        self._authorize(request)
        inst = self._pool.drain(self._url(await self._json(request)))
        return json_response(inst.describe())

    async def _undrain(self, request: HttpRequest) -> HttpResponse:
        self._authorize(request)
        inst = self._pool.undrain(self._url(await self._json(request)))
        return json_response(inst.describe())

    async def _role(self, request: HttpRequest) -> HttpResponse:
        self._authorize(request)
        data = await self._json(request)
        url = self._url(data)
        try:
            inst = self._pool.set_role(url, data.get("role"))  # type: ignore[arg-type]
        except ConfigError as e:
            raise bad_request(str(e), "role", "invalid_value") from None
        return json_response(inst.describe())
