"""Typed proxy configuration from flags and/or a YAML file, validated at start-up.

Any unknown key or bad value raises :class:`ConfigError` naming the key, so a
typo stops start-up instead of silently using a default.
"""

from __future__ import annotations

import dataclasses
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vllm_pd.connector.deployment_secret import load_secret
from vllm_pd.connector.transport.tls_stream import TlsSettings
from vllm_pd.errors import ConfigError
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.router.backend.backend_url import parse_networks
from vllm_pd.router.backend.sse_relay import DEFAULT_MAX_EVENT_BYTES
from vllm_pd.router.http.client_auth import check_api_key
from vllm_pd.router.http.http_limits import (
    DEFAULT_BODY_TIMEOUT,
    DEFAULT_HEADER_TIMEOUT,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_MAX_HEADERS,
    DEFAULT_MAX_URL_BYTES,
)
from vllm_pd.router.request.block_hashes import HASH_ALGOS as KV_HASH_ALGOS

ROLES = ("prefill", "decode", "both")
KV_MODES = ("push", "pull", "auto")
PREFILL_POLICIES = ("round_robin", "least_outstanding", "power_of_two", "prefix_aware", "kv_aware")
DECODE_POLICIES = ("round_robin", "least_outstanding", "power_of_two", "kv_aware")


# the connector's transports (vllm_pd.connector.transport): shm only between instances on one host
KV_SCHEMES = ("tcp", "shm", "nixl")


@dataclass
class InstanceConfig:
    url: str  # the instance's OpenAI API: http(s)://host:port, no path
    role: str  # prefill | decode | both (a kv_both instance: the supervisor picks which leg it serves)
    kv_endpoint: str | None = None  # "tcp://host:port" (or shm:// on one host, nixl://) of its KV endpoint (push mode)
    kv_events: str | None = None  # "tcp://host:port" of its vLLM KV-event publisher (kv_aware routing)

    def __post_init__(self) -> None:
        self.url = _check_url(self.url, "url")
        if self.kv_events is not None and not self.kv_events.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"kv_events: {self.kv_events!r} is not a tcp:// or ipc:// ZMQ endpoint")
        if self.role not in ROLES:
            raise ConfigError(f"role: {self.role!r} is not one of {ROLES}")
        if self.kv_endpoint is not None:
            parsed = urlparse(self.kv_endpoint)
            if parsed.scheme not in KV_SCHEMES or not parsed.hostname or not parsed.port:
                raise ConfigError(
                    f"kv_endpoint: {self.kv_endpoint!r} is not tcp://host:port (or shm://host:port, nixl://host:port)"
                )


@dataclass
class K8sDiscoveryConfig:
    """Instances found in Kubernetes (``--service-discovery k8s``): the pods of one label selector per role,
    watched (router/pool/k8s_discovery.py)."""

    prefill_selector: str | None = None
    decode_selector: str | None = None
    both_selector: str | None = None
    namespace: str | None = None  # namespace of the pods; None: the service account's own namespace
    # the Kubernetes API server's URL; None: in the cluster (KUBERNETES_SERVICE_HOST, service account token and CA)
    api_url: str | None = None
    http_port: int = 8000  # for pods with neither a vllm-pd/http-port annotation nor a container port "http"
    watch_timeout: float = 300.0  # seconds the API server keeps one watch open before we renew it
    backoff_max: float = 30.0  # seconds at most between reconnects to an unreachable API server
    reap_interval: float = 1.0  # seconds between checks whether a drained instance's requests have finished

    def __post_init__(self) -> None:
        from vllm_pd.router.k8s.k8s_selector import parse_selector

        if not self.selectors():
            raise ConfigError("kubernetes: no prefill_selector, decode_selector or both_selector")
        for role, selector in self.selectors().items():
            try:
                parse_selector(selector)
            except ValueError as e:
                raise ConfigError(f"kubernetes.{role}_selector: {e}") from None
        if self.api_url is not None:
            self.api_url = _check_url(self.api_url, "kubernetes.api_url")
        if not 0 < self.http_port < 65536:
            raise ConfigError(f"kubernetes.http_port: {self.http_port} is out of range")
        for name in ("watch_timeout", "backoff_max", "reap_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"kubernetes.{name}: must be > 0, got {getattr(self, name)}")

    def selectors(self) -> dict[str, str]:
        """role -> label selector, for the roles that have one."""
        given = {"prefill": self.prefill_selector, "decode": self.decode_selector, "both": self.both_selector}
        return {role: sel for role, sel in given.items() if sel is not None}


@dataclass
class ProxyConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    instances: list[InstanceConfig] = field(default_factory=list)
    kv_mode: str = "auto"  # push | pull (auto = push: measured fastest, see docs/benchmarks/pd-latency.md)
    # how a prefill leg's instance is chosen: prefix_aware keeps a prompt prefix on the instance it went to;
    # kv_aware goes where its KV is (vLLM's KV events, the store master); the others by load or in turn
    prefill_policy: str = "prefix_aware"
    decode_policy: str = "least_outstanding"  # how a decode leg's instance is chosen (kv_aware as above)
    require_disagg: bool = False  # never fall back to decode-only when no prefill works
    short_prompt_tokens: int = 0  # prompts with at most this many tokens skip prefill (0 = never)
    prefill_timeout: float = 300.0  # seconds for the whole prefill leg
    decode_timeout: float = 600.0  # seconds until decode's response headers
    decode_idle_timeout: float = 300.0  # seconds between two chunks of decode's stream
    connect_timeout: float = 5.0
    max_body_bytes: int = 32 * 1024 * 1024
    prefill_attempts: int = 3
    decode_attempts: int = 3
    health_interval: float = 5.0
    health_timeout: float = 2.0
    # an instance a leg has waited on this long without a byte from it is probed (GET /health, probe_timeout):
    # two failed probes mark it unreachable and its legs move on - no probe while no leg waits (partition_watch.py)
    probe_after: float = 1.0
    probe_timeout: float = 1.0
    # what a backend can make the proxy hold (bytes): prefill's answer, decode's whole answer, one SSE event of
    # decode's stream, the body of a backend's error answer
    max_prefill_answer_bytes: int = 16 * 1024 * 1024
    max_decode_answer_bytes: int = 64 * 1024 * 1024
    max_sse_event_bytes: int = DEFAULT_MAX_EVENT_BYTES
    max_error_body_bytes: int = 64 * 1024
    breaker_failures: int = 5  # consecutive failures that open an instance's breaker
    breaker_cooldown: float = 10.0  # seconds an open breaker stays open before a probe
    admin_token: str | None = None  # admin API disabled when unset
    supervisor: bool = False  # choose roles of "both" instances from observed load
    supervisor_interval: float = 2.0  # seconds between the supervisor's decisions (YAML only)
    supervisor_ttft_slo: float = 2.0  # seconds; the supervisor balances TTFT/slo against TPOT/slo
    supervisor_tpot_slo: float = 0.1  # seconds per output token
    supervisor_profile: str | None = None  # a `vllm-pd profile` file: the supervisor also predicts with it
    tokenizer: str | None = None  # HF tokenizer dir for exact prompt lengths (else ~4 bytes/token)
    model_names: list[str] = field(default_factory=list)  # extra accepted model names
    kubernetes: K8sDiscoveryConfig | None = None  # instances also come from Kubernetes pods
    otlp_endpoint: str | None = None  # OTLP traces endpoint (else OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT)
    request_log: str | None = None  # JSON lines, one per request, to this file ("-": standard error)
    drain_grace: float = 30.0  # seconds in-flight requests get to finish after SIGTERM
    # security (client_auth.py, backend_url.py) and limits (http_limits.py, admission.py)
    api_key: str | None = None  # clients must send "Authorization: Bearer <key>" on /v1/*
    backend_api_key: str | None = None  # sent to the instances (legs and health checks) instead of the client's
    backend_networks: list[str] = field(default_factory=list)  # CIDRs the admin API may add instances in
    backend_ca_file: str | None = None  # CA bundle for https:// instances (default: the system's)
    backend_tls_verify: bool = True  # False: https:// instances' certificates are not checked
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    max_headers: int = DEFAULT_MAX_HEADERS
    max_url_bytes: int = DEFAULT_MAX_URL_BYTES
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    max_concurrent_requests: int = 0  # completions served at once (0 = no limit)
    max_queued_requests: int = 256  # completions waiting for a slot beyond that; more get 429
    kv_hash_algo: str = "sha256"  # the servers' --prefix-caching-hash-algo (kv_aware)
    kv_load_weight: float = 1.0  # kv_aware: queued prompt tokens weigh this much against uncached ones
    # kv_aware: "tcp://host:port" of the KV store's master (`vllm-pd store-master`), read as a second
    # source of where prompts' KV lives (router/routing/store_locations.py); None = vLLM's KV events only
    store_master: str | None = None
    # the deployment secret's file (else VLLM_PD_SECRET): the proxy's KV releases and store master
    # lookups authenticate with it (protocol/auth_handshake.py)
    secret_file: str | None = None
    # TLS of the instances' tcp KV endpoints (their tls_cert / tls_key / tls_ca): the proxy's releases
    # present this certificate and check theirs against the CA
    kv_tls_cert: str | None = None
    kv_tls_key: str | None = None
    kv_tls_ca: str | None = None
    secret: DeploymentSecret | None = field(default=None, init=False, repr=False, compare=False)  # loaded
    kv_tls: TlsSettings | None = field(default=None, init=False, compare=False)  # loaded

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.kv_mode not in KV_MODES:
            raise ConfigError(f"kv_mode: {self.kv_mode!r} is not one of {KV_MODES}")
        if self.prefill_policy not in PREFILL_POLICIES:
            raise ConfigError(f"prefill_policy: {self.prefill_policy!r} is not one of {PREFILL_POLICIES}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ConfigError(f"decode_policy: {self.decode_policy!r} is not one of {DECODE_POLICIES}")
        if not 0 < self.port < 65536:
            raise ConfigError(f"port: {self.port} is out of range")
        for name in (
            "prefill_timeout",
            "decode_timeout",
            "decode_idle_timeout",
            "connect_timeout",
            "health_interval",
            "health_timeout",
            "probe_after",
            "probe_timeout",
            "breaker_cooldown",
            "supervisor_interval",
            "supervisor_ttft_slo",
            "supervisor_tpot_slo",
            "header_timeout",
            "body_timeout",
        ):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in (
            "max_body_bytes",
            "prefill_attempts",
            "decode_attempts",
            "breaker_failures",
            "max_header_bytes",
            "max_headers",
            "max_url_bytes",
            "max_prefill_answer_bytes",
            "max_decode_answer_bytes",
            "max_sse_event_bytes",
            "max_error_body_bytes",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.drain_grace < 0:
            raise ConfigError(f"drain_grace: must be >= 0, got {self.drain_grace}")
        for name in ("max_concurrent_requests", "max_queued_requests"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        try:
            for name in ("api_key", "backend_api_key"):
                check_api_key(getattr(self, name), name)
            parse_networks(self.backend_networks, "backend_networks")
        except ValueError as e:  # the message names the key
            raise ConfigError(str(e)) from None
        if self.backend_ca_file is not None:
            try:  # a CA file that cannot be read stops start-up, not the first https:// request
                ssl.create_default_context(cafile=self.backend_ca_file)
            except (OSError, ValueError) as e:  # (ssl.SSLError is an OSError)
                raise ConfigError(f"backend_ca_file: {self.backend_ca_file!r}: {e}") from None
        try:
            self.secret = load_secret(self.secret_file, "secret_file")
            self.kv_tls = TlsSettings.from_keys(self.kv_tls_cert, self.kv_tls_key, self.kv_tls_ca, "kv_")
        except ValueError as e:  # the message names the key
            raise ConfigError(str(e)) from None
        if self.kv_hash_algo not in KV_HASH_ALGOS:
            raise ConfigError(f"kv_hash_algo: {self.kv_hash_algo!r} is not one of {KV_HASH_ALGOS}")
        if self.kv_load_weight < 0:
            raise ConfigError(f"kv_load_weight: must be >= 0, got {self.kv_load_weight}")
        if self.store_master is not None:
            _check_zmq_tcp(self.store_master, "store_master")
            if "kv_aware" not in (self.prefill_policy, self.decode_policy):
                raise ConfigError(
                    "store_master: only the kv_aware policy reads it; set --prefill-policy kv_aware "
                    "(or --decode-policy kv_aware)"
                )
        if "kv_aware" in (self.prefill_policy, self.decode_policy) and not self.tokenizer:
            raise ConfigError("tokenizer: the kv_aware policy needs the model's tokenizer directory")
        if self.short_prompt_tokens < 0:
            raise ConfigError(f"short_prompt_tokens: must be >= 0, got {self.short_prompt_tokens}")
        urls = [i.url for i in self.instances]
        dup = {u for u in urls if urls.count(u) > 1}
        if dup:
            raise ConfigError(f"instances: duplicate url {sorted(dup)[0]}")


def _check_zmq_tcp(address: str, key: str) -> None:
    """A ``tcp://host:port`` ZMQ address with a real port."""
    parsed = urlparse(address)
    try:
        port = parsed.port
    except ValueError:
        port = None
    if parsed.scheme != "tcp" or not parsed.hostname or not port or parsed.path not in ("", "/"):
        raise ConfigError(f"{key}: {address!r} is not tcp://HOST:PORT (the `vllm-pd store-master` address)")


def _check_url(url: Any, key: str) -> str:
    if not isinstance(url, str):
        raise ConfigError(f"{key}: expected a string, got {type(url).__name__}")
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ConfigError(f"{key}: {url!r} is not an http(s) URL")
    if "@" in parsed.netloc or parsed.path not in ("", "/") or parsed.params or parsed.query or parsed.fragment:
        raise ConfigError(f"{key}: {url!r} must be scheme://host[:port] alone (no credentials, path or query)")
    try:
        port = parsed.port
    except ValueError as e:
        raise ConfigError(f"{key}: {url!r}: {e}") from None
    if port == 0:
        raise ConfigError(f"{key}: {url!r}: port 0")
    return url.rstrip("/")


def parse_instance_flag(value: str, role: str) -> InstanceConfig:
    """``http://h:p`` or ``http://h:p@tcp://h:kvport`` (the KV endpoint after "@"; or shm://, nixl://)."""
    url, sep, kv = value.partition("@")
    return InstanceConfig(url=url, role=role, kv_endpoint=kv if sep else None)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "host": str,
    "port": int,
    "kv_mode": str,
    "prefill_policy": str,
    "decode_policy": str,
    "require_disagg": bool,
    "short_prompt_tokens": int,
    "prefill_timeout": (int, float),
    "decode_timeout": (int, float),
    "decode_idle_timeout": (int, float),
    "connect_timeout": (int, float),
    "max_body_bytes": int,
    "prefill_attempts": int,
    "decode_attempts": int,
    "health_interval": (int, float),
    "health_timeout": (int, float),
    "probe_after": (int, float),
    "probe_timeout": (int, float),
    "max_prefill_answer_bytes": int,
    "max_decode_answer_bytes": int,
    "max_sse_event_bytes": int,
    "max_error_body_bytes": int,
    "breaker_failures": int,
    "breaker_cooldown": (int, float),
    "admin_token": str,
    "supervisor": bool,
    "supervisor_interval": (int, float),
    "supervisor_ttft_slo": (int, float),
    "supervisor_tpot_slo": (int, float),
    "supervisor_profile": str,
    "tokenizer": str,
    "model_names": list,
    "otlp_endpoint": str,
    "request_log": str,
    "drain_grace": (int, float),
    "api_key": str,
    "backend_api_key": str,
    "backend_networks": list,
    "backend_ca_file": str,
    "backend_tls_verify": bool,
    "max_header_bytes": int,
    "max_headers": int,
    "max_url_bytes": int,
    "header_timeout": (int, float),
    "body_timeout": (int, float),
    "max_concurrent_requests": int,
    "max_queued_requests": int,
    "kv_hash_algo": str,
    "kv_load_weight": (int, float),
    "store_master": str,
    "secret_file": str,
    "kv_tls_cert": str,
    "kv_tls_key": str,
    "kv_tls_ca": str,
}
assert set(_FIELD_TYPES) | {"instances", "kubernetes", "secret", "kv_tls"} == {
    f.name for f in dataclasses.fields(ProxyConfig)
}


def config_from_mapping(data: Any, where: str = "config") -> dict[str, Any]:
    """Validate a YAML mapping into ProxyConfig keyword arguments."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping at the top level")
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key == "instances":
            out["instances"] = _instances_from_list(value)
            continue
        if key == "kubernetes":
            out["kubernetes"] = _kubernetes_from_mapping(value)
            continue
        if key not in _FIELD_TYPES:
            raise ConfigError(
                f"{key}: unknown key in {where} (known: instances, kubernetes, {', '.join(sorted(_FIELD_TYPES))})"
            )
        want = _FIELD_TYPES[key]
        # bool is an int subclass; reject it where a number is wanted
        if not isinstance(value, want) or (isinstance(value, bool) and want is not bool):
            raise ConfigError(f"{key}: expected {_type_name(want)}, got {value!r}")
        out[key] = value
    return out


def _instances_from_list(value: Any) -> list[InstanceConfig]:
    if not isinstance(value, list):
        raise ConfigError("instances: expected a list")
    result = []
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise ConfigError(f"instances[{i}]: expected a mapping with url and role")
        unknown = set(item) - {"url", "role", "kv_endpoint", "kv_events"}
        if unknown:
            raise ConfigError(
                f"instances[{i}].{sorted(unknown)[0]}: unknown key (known: url, role, kv_endpoint, kv_events)"
            )
        for req in ("url", "role"):
            if req not in item:
                raise ConfigError(f"instances[{i}].{req}: missing")
        try:
            result.append(
                InstanceConfig(
                    url=item["url"],
                    role=item["role"],
                    kv_endpoint=item.get("kv_endpoint"),
                    kv_events=item.get("kv_events"),
                )
            )
        except ConfigError as e:
            raise ConfigError(f"instances[{i}].{e}") from None
    return result


def _kubernetes_from_mapping(value: Any) -> K8sDiscoveryConfig:
    if not isinstance(value, dict):
        raise ConfigError("kubernetes: expected a mapping (prefill_selector, decode_selector, namespace, ...)")
    known = {f.name: f.type for f in dataclasses.fields(K8sDiscoveryConfig)}
    for key, item in value.items():
        if key not in known:
            raise ConfigError(f"kubernetes.{key}: unknown key (known: {', '.join(known)})")
        numbers: dict[str, type | tuple[type, ...]] = {"int": int, "float": (int, float)}
        want = numbers.get(str(known[key]), str)
        if not isinstance(item, want) or isinstance(item, bool):
            raise ConfigError(f"kubernetes.{key}: expected {_type_name(want)}, got {item!r}")
    return K8sDiscoveryConfig(**value)


def load_yaml(path: str | Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as e:
        raise ConfigError(f"config file {path}: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path}: invalid YAML: {e}") from None
    return config_from_mapping(data or {}, where=str(path))


def _type_name(t: type | tuple[type, ...]) -> str:
    if isinstance(t, tuple):
        return "a number"
    return {str: "a string", int: "an integer", bool: "true/false", list: "a list"}[t]
