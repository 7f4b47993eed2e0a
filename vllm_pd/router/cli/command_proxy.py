"""``vllm-pd proxy``: run the PD proxy in front of existing vLLM instances."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
from typing import Any

from vllm_pd.router.config import (
    DECODE_POLICIES,
    KV_HASH_ALGOS,
    KV_MODES,
    PREFILL_POLICIES,
    ConfigError,
    InstanceConfig,
    K8sDiscoveryConfig,
    ProxyConfig,
    load_yaml,
    parse_instance_flag,
)
from vllm_pd.router.k8s.k8s_api import ApiError

logger = logging.getLogger(__name__)

FULL_COLLECTION_EVERY = 1000  # middle-generation collections between two full ones (Python's default: 10)

# flag dest -> ProxyConfig field, for flags that override the YAML file when given
_SCALAR_FLAGS = (
    "host",
    "port",
    "kv_mode",
    "prefill_policy",
    "decode_policy",
    "require_disagg",
    "short_prompt_tokens",
    "prefill_timeout",
    "decode_timeout",
    "decode_idle_timeout",
    "connect_timeout",
    "max_body_bytes",
    "prefill_attempts",
    "decode_attempts",
    "health_interval",
    "health_timeout",
    "breaker_failures",
    "breaker_cooldown",
    "admin_token",
    "supervisor",
    "supervisor_ttft_slo",
    "supervisor_tpot_slo",
    "supervisor_profile",
    "tokenizer",
    "otlp_endpoint",
    "request_log",
    "drain_grace",
    "api_key",
    "backend_api_key",
    "backend_networks",
    "backend_ca_file",
    "backend_tls_verify",
    "max_header_bytes",
    "max_headers",
    "max_url_bytes",
    "header_timeout",
    "body_timeout",
    "max_concurrent_requests",
    "max_queued_requests",
    "kv_hash_algo",
    "kv_load_weight",
    "store_master",
    "secret_file",
    "kv_tls_cert",
    "kv_tls_key",
    "kv_tls_ca",
    "probe_after",
    "probe_timeout",
    "max_prefill_answer_bytes",
    "max_decode_answer_bytes",
    "max_sse_event_bytes",
    "max_error_body_bytes",
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML file with any ProxyConfig field and 'instances' (flags override it)")
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8000)")
    p.add_argument("--prefill", action="append", default=[], metavar="URL", help="a prefill instance (repeatable)")
    p.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL[@tcp://HOST:KVPORT]",
        help="a decode instance, optionally with its KV endpoint after '@' (repeatable)",
    )
    p.add_argument(
        "--decode-kv",
        action="append",
        default=[],
        metavar="tcp://HOST:KVPORT",
        help="KV endpoint of the decode instance given in the same position",
    )
    p.add_argument(
        "--both",
        action="append",
        default=[],
        metavar="URL[@tcp://HOST:KVPORT]",
        help="a kv_both instance that can serve either leg (repeatable)",
    )
    p.add_argument(
        "--kv-mode",
        choices=KV_MODES,
        help="with a decode KV endpoint both legs go out at once; push: "
        "prefill writes each layer into decode while computing; pull: decode reads the KV once "
        "prefill announces it; auto (default): push, the fastest measured "
        "(docs/benchmarks/pd-latency.md)",
    )
    p.add_argument("--prefill-policy", choices=PREFILL_POLICIES, help="default prefix_aware")
    p.add_argument("--decode-policy", choices=DECODE_POLICIES, help="default least_outstanding")
    p.add_argument(
        "--require-disagg",
        action="store_true",
        default=None,
        help="fail requests instead of letting decode compute the prompt when no prefill works",
    )
    p.add_argument("--short-prompt-tokens", type=int, help="prompts this short skip prefill (default 0)")
    p.add_argument("--prefill-timeout", type=float, help="seconds for the prefill leg (default 300)")
    p.add_argument("--decode-timeout", type=float, help="seconds until decode answers (default 600)")
    p.add_argument("--decode-idle-timeout", type=float, help="max seconds between stream chunks (default 300)")
    p.add_argument("--connect-timeout", type=float, help="backend connect timeout (default 5)")
    p.add_argument("--max-body-bytes", type=int, help="request body size limit (default 32 MiB)")
    p.add_argument("--prefill-attempts", type=int, help="prefill instances tried per request (default 3)")
    p.add_argument("--decode-attempts", type=int, help="decode instances tried per request (default 3)")
    p.add_argument("--health-interval", type=float, help="seconds between health checks (default 5)")
    p.add_argument(
        "--health-timeout",
        type=float,
        help="seconds a health check may take (default 2); two failed "
        "checks in a row mark an instance unreachable and the legs waiting on it move on",
    )
    p.add_argument(
        "--probe-after",
        type=float,
        help="an instance a leg has waited on this many seconds without "
        "a byte from it is probed at once (default 1); no probes while no leg waits",
    )
    p.add_argument(
        "--probe-timeout",
        type=float,
        help="seconds such a probe may take (default 1); two failed "
        "probes mark the instance unreachable and the legs waiting on it move on",
    )
    p.add_argument("--breaker-failures", type=int, help="consecutive failures that open a breaker (default 5)")
    p.add_argument("--breaker-cooldown", type=float, help="seconds a breaker stays open (default 10)")
    p.add_argument(
        "--admin-token",
        default=os.environ.get("VLLM_PD_ADMIN_TOKEN"),
        help="bearer token of the admin API (env VLLM_PD_ADMIN_TOKEN); admin API off without it",
    )
    p.add_argument(
        "--supervisor",
        action="store_true",
        default=None,
        help="let observed load choose the role of each --both instance",
    )
    p.add_argument(
        "--supervisor-ttft-slo", type=float, help="TTFT target in seconds the supervisor balances against (default 2)"
    )
    p.add_argument("--supervisor-tpot-slo", type=float, help="TPOT target in seconds (default 0.1)")
    p.add_argument(
        "--supervisor-profile",
        help="a `vllm-pd profile` file: the supervisor predicts TTFT/TPOT "
        "from the queues with the planner's cost model and moves an instance only where it helps",
    )
    p.add_argument("--tokenizer", help="HF model dir whose tokenizer.json counts prompt tokens exactly")
    k8s = p.add_argument_group("Kubernetes service discovery (the YAML file's 'kubernetes' mapping)")
    k8s.add_argument(
        "--service-discovery",
        choices=("static", "k8s"),
        help="k8s: also route to the Ready pods of the selectors below, watched (default: k8s when "
        "the YAML file has a 'kubernetes' mapping, else static)",
    )
    k8s.add_argument("--k8s-namespace", help="namespace of the pods (default: the proxy's own)")
    k8s.add_argument(
        "--k8s-api-url", help="the API server's URL (default: in the cluster, with the pod's service account)"
    )
    k8s.add_argument(
        "--k8s-port",
        type=int,
        help="HTTP port of pods without a vllm-pd/http-port annotation or a container port named http (default 8000)",
    )
    for role in ("prefill", "decode", "both"):
        k8s.add_argument(
            f"--{role}-selector", metavar="LABELS", help=f"label selector of the {role} pods, e.g. app=vllm,role={role}"
        )
    p.add_argument(
        "--otlp-endpoint",
        help="export OpenTelemetry spans of each request and its legs to this OTLP "
        "traces endpoint (else OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT; protocol from "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, default grpc)",
    )
    p.add_argument(
        "--request-log",
        metavar="PATH",
        help="one JSON line per request (id, instances, leg times, outcome) to PATH ('-': standard error)",
    )
    p.add_argument(
        "--drain-grace",
        type=float,
        help="on SIGTERM: seconds in-flight requests get to finish "
        "before both legs of what remains are cancelled (default 30; SIGINT: 0)",
    )
    p.add_argument(
        "--kv-events",
        action="append",
        default=[],
        metavar="URL=tcp://HOST:PORT",
        help="an instance's vLLM KV-event publisher (--kv-events-config endpoint), for kv_aware",
    )
    p.add_argument(
        "--kv-hash-algo",
        choices=KV_HASH_ALGOS,
        help="the servers' --prefix-caching-hash-algo (default sha256, vLLM's default)",
    )
    p.add_argument(
        "--kv-load-weight",
        type=float,
        help="kv_aware: weight of queued prompt tokens against uncached ones (default 1)",
    )
    p.add_argument(
        "--store-master",
        metavar="tcp://HOST:PORT",
        help="kv_aware: also learn where prompts' KV lives from the KV store's master (the servers' "
        "store.master); a prefill leg is then told which store node to fetch from",
    )
    _add_security_and_limit_arguments(p)


def _add_security_and_limit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--secret-file",
        metavar="FILE",
        help="the deployment secret (else env VLLM_PD_SECRET): KV releases and store master lookups "
        "authenticate with it, as the servers' connections do",
    )
    p.add_argument(
        "--kv-tls-cert",
        metavar="PEM",
        help="with --kv-tls-key and --kv-tls-ca: TLS to the servers' tcp "
        "KV endpoints (their tls_cert/tls_key/tls_ca), for the proxy's KV releases",
    )
    p.add_argument("--kv-tls-key", metavar="PEM", help="the key of --kv-tls-cert")
    p.add_argument("--kv-tls-ca", metavar="PEM", help="the CA that signed the servers' certificates")
    p.add_argument(
        "--api-key",
        default=os.environ.get("VLLM_PD_API_KEY"),
        help="clients must send 'Authorization: Bearer KEY' on /v1/* (env VLLM_PD_API_KEY)",
    )
    p.add_argument(
        "--backend-api-key",
        default=os.environ.get("VLLM_PD_BACKEND_API_KEY"),
        help="key sent to the instances (their vllm serve --api-key), on legs and health checks "
        "(env VLLM_PD_BACKEND_API_KEY); default: the client's Authorization is forwarded",
    )
    p.add_argument(
        "--backend-network",
        dest="backend_networks",
        action="append",
        metavar="CIDR",
        help="a network the admin API may add instances in (repeatable; default any address "
        "except link-local and metadata ones)",
    )
    p.add_argument("--backend-ca-file", help="CA bundle for https:// instances (default: the system's)")
    p.add_argument(
        "--no-backend-tls-verify",
        dest="backend_tls_verify",
        action="store_false",
        default=None,
        help="do not check the certificates of https:// instances",
    )
    p.add_argument("--max-header-bytes", type=int, help="request head size limit, 431 beyond (default 32 KiB)")
    p.add_argument("--max-headers", type=int, help="header fields per request, 431 beyond (default 100)")
    p.add_argument("--max-url-bytes", type=int, help="URL length limit, 414 beyond (default 8 KiB)")
    p.add_argument(
        "--header-timeout", type=float, help="seconds a client has to send a request head (default 10), 408 beyond"
    )
    p.add_argument(
        "--body-timeout", type=float, help="seconds a client has to send a body after its head (default 60), 408 beyond"
    )
    p.add_argument("--max-concurrent-requests", type=int, help="completions served at once (default 0: no limit)")
    p.add_argument(
        "--max-prefill-answer-bytes",
        type=int,
        help="a prefill answer longer than this fails its leg, which moves on like any failed prefill (default 16 MiB)",
    )
    p.add_argument(
        "--max-decode-answer-bytes",
        type=int,
        help="a non-streamed decode answer longer than this ends the request with 502 (default 64 MiB)",
    )
    p.add_argument(
        "--max-sse-event-bytes",
        type=int,
        help="one SSE event of decode's stream longer than this, "
        "finished or not, ends the stream with an error event (default 4 MiB)",
    )
    p.add_argument("--max-error-body-bytes", type=int, help="bytes read of a backend's error answer (default 64 KiB)")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        help="completions waiting beyond that limit (default 256); more get 429 with Retry-After",
    )


def config_from_args(args: argparse.Namespace) -> ProxyConfig:
    kw: dict[str, Any] = load_yaml(args.config) if args.config else {}
    for name in _SCALAR_FLAGS:
        value = getattr(args, name, None)
        if value is not None:
            kw[name] = value
    instances = list(kw.pop("instances", []))
    instances += [parse_instance_flag(u, "prefill") for u in args.prefill]
    if args.decode_kv and len(args.decode_kv) != len(args.decode):
        raise ConfigError(f"decode_kv: {len(args.decode_kv)} --decode-kv for {len(args.decode)} --decode")
    for i, u in enumerate(args.decode):
        ic = parse_instance_flag(u, "decode")
        if args.decode_kv:
            ic = parse_instance_flag(f"{ic.url}@{args.decode_kv[i]}", "decode")
        instances.append(ic)
    instances += [parse_instance_flag(u, "both") for u in args.both]
    _attach_kv_events(instances, args.kv_events)
    discovery = getattr(args, "service_discovery", None)
    if discovery == "static":
        kw.pop("kubernetes", None)
    elif discovery == "k8s" or "kubernetes" in kw:
        kw["kubernetes"] = _kubernetes_from_args(args, kw.get("kubernetes"))
    else:
        given = [
            f
            for f in (
                "k8s_namespace",
                "k8s_api_url",
                "k8s_port",
                "prefill_selector",
                "decode_selector",
                "both_selector",
            )
            if getattr(args, f, None) is not None
        ]
        if given:
            raise ConfigError(f"{given[0]}: only with --service-discovery k8s")
    cfg = ProxyConfig(instances=instances, **kw)
    if cfg.kv_mode == "push":
        for ic in cfg.instances:
            if ic.role != "prefill" and ic.kv_endpoint is None:
                logger.warning("kv_mode push: %s has no kv_endpoint, it is served in pull mode", ic.url)
    return cfg


def _kubernetes_from_args(args: argparse.Namespace, from_file: K8sDiscoveryConfig | None) -> K8sDiscoveryConfig:
    """The YAML file's ``kubernetes`` settings, overridden by the flags given."""
    kw = dataclasses.asdict(from_file) if from_file is not None else {}
    flags = {
        "namespace": args.k8s_namespace,
        "api_url": args.k8s_api_url,
        "http_port": args.k8s_port,
        "prefill_selector": args.prefill_selector,
        "decode_selector": args.decode_selector,
        "both_selector": args.both_selector,
    }
    kw.update({k: v for k, v in flags.items() if v is not None})
    return K8sDiscoveryConfig(**kw)


def _attach_kv_events(instances: list[InstanceConfig], flags: list[str]) -> None:
    by_url = {ic.url: ic for ic in instances}
    for flag in flags:
        url, sep, endpoint = flag.partition("=")
        ic = by_url.get(url.rstrip("/"))
        if not sep or ic is None:
            raise ConfigError(f"kv_events: {flag!r} is not URL=tcp://HOST:PORT for a configured instance")
        ic.kv_events = endpoint
        ic.__post_init__()  # validates the endpoint


def install_uvloop() -> None:
    # VLLM_PD_PROXY_LOOP=asyncio keeps the stock loop (used by the stack comparison benchmark)
    if os.environ.get("VLLM_PD_PROXY_LOOP") == "asyncio":
        return
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def serve_until_signal(cfg: ProxyConfig) -> None:
    from vllm_pd.router.server.app import ProxyServer, serve
    from vllm_pd.router.server.drain import drain

    server = ProxyServer(cfg)
    runner = await serve(server)
    # what start-up built (modules, config, metrics) lives as long as the process: out of the
    # collector's sight, full collections under load only walk the requests' own objects
    gc.freeze()
    # and full collections are rare: a request's objects form no cycles (tests/unit/router/test_proxy_memory.py,
    # tests/unit/router/test_proxy_backend_memory.py: freed by reference counting as each leg ends), so a full pass
    # finds next to nothing, but it walks every live request's objects - at 1,000 streams a 50-200 ms
    # stall of every stream, every few seconds with the default (one per 10 middle-generation passes)
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)
    stop, hurry = asyncio.Event(), asyncio.Event()
    grace = cfg.drain_grace
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        nonlocal grace
        if stop.is_set():  # a second signal: stop now
            hurry.set()
        if sig == signal.SIGINT:
            grace = 0.0
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        await stop.wait()
    finally:
        await drain(runner, grace, hurry)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ConfigError as e:
        print(f"vllm-pd proxy: configuration error: {e}", file=sys.stderr)
        return 2
    if not cfg.instances and cfg.kubernetes is None:
        logger.warning("no instances configured; add them with the admin API")
    install_uvloop()
    try:
        asyncio.run(serve_until_signal(cfg))
    except ApiError as e:  # no way to reach the Kubernetes API at start-up
        print(f"vllm-pd proxy: service discovery: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m vllm_pd.router.cli.command_proxy")
    add_arguments(_parser)
    _parser.add_argument("--log-level", default="WARNING")
    _args = _parser.parse_args()
    logging.basicConfig(level=_args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run(_args))
