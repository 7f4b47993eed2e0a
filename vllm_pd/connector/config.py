"""The connector's typed settings, read from ``kv_connector_extra_config``.

Validated once at start-up: an unknown key or a bad value raises
:class:`ConfigError` naming the key, so vLLM stops before serving anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args

from vllm_pd.connector.deployment_secret import check_bind, is_loopback, load_secret
from vllm_pd.connector.transport.tls_stream import TlsSettings
from vllm_pd.errors import ConfigError
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.transfer_params import LoadMode, TransferMode

TransportName = Literal["tcp", "shm", "nixl"]

_SIZE_SUFFIXES = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

# decode: pushes (or a decode leg's awaited announcement) that pause this long get prefill probed - a
# ping, an RTT when prefill is there, peer_probe_s when it is not (or push_wait_s, if that is shorter)
PROBE_PAUSED_PUSHES_S = 1.0


def parse_size(key: str, value: object) -> int:
    """Bytes from an int or a string like ``512m`` / ``2G``; errors name ``key``."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and value.strip():
        s = value.strip().lower().removesuffix("b").removesuffix("i")
        mult = _SIZE_SUFFIXES.get(s[-1], 1) if s else 1
        digits = s[:-1] if s and s[-1] in _SIZE_SUFFIXES else s
        try:
            n = int(float(digits) * mult)
        except ValueError:
            raise ConfigError(f"{key}: not a size: {value!r}") from None
    else:
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if n < 0:
        raise ConfigError(f"{key}: must be >= 0, got {value!r}")
    return n


@dataclass(frozen=True)
class PDConnectorConfig:
    # transport between instances: tcp (any hosts), shm (one host: POSIX shared memory and layer plans)
    # or nixl (NIXL over UCX: cma on one host, RDMA or tcp between hosts, GPU memory registered as is;
    # needs the nixl extra, which install.sh installs)
    transport: TransportName = "tcp"
    # address peers use to reach this instance's KV endpoint ("auto": this host's IP)
    host: str = "auto"
    # address to bind the KV endpoint to ("auto": every interface with a deployment secret or
    # insecure_network, else 127.0.0.1 only)
    bind_host: str = "auto"
    # file holding the deployment secret (else the VLLM_PD_SECRET environment variable): every KV
    # connection proves it holds it (protocol/auth_handshake.py); None and no variable: loopback only
    secret_file: str | None = None
    # listen beyond loopback without a deployment secret (anyone reaching the port can read,
    # write and release KV): only on a network nothing else can reach
    insecure_network: bool = False
    # TLS for the tcp transport and the store's node-to-node fetches (PEM files; all three or none):
    # this instance's certificate and key, and the CA that signed every instance's certificate
    tls_cert: str | None = None
    tls_key: str | None = None  # this instance's private key (PEM), with tls_cert and tls_ca
    tls_ca: str | None = None  # the CA (PEM) that signed every instance's certificate, with tls_cert and tls_key
    # mode a prefill instance uses when the proxy's kv_transfer_params don't say
    default_mode: TransferMode = "pull"
    # async: a request waits (off the batch) until its KV has landed;
    # layerwise: its first forward waits per layer while later layers still arrive;
    # auto: layer-wise while this instance has no other request (nothing to stall), else async.
    # A decode leg may choose per request ("load_mode" in its kv_transfer_params). On GPUs async
    # without a store keeps vLLM's FULL CUDA graphs (no load is then layer-wise); auto, layerwise or a
    # store make vLLM capture PIECEWISE graphs, whose per-layer waits run
    load_mode: LoadMode = "auto"
    # prefill holds a request's blocks at most this long for decode to take them
    lease_s: float = 60.0
    # one transfer (all layers of one request) must complete within this
    transfer_timeout_s: float = 30.0
    # decode: pushed KV that has not fully arrived is waited for while pushes keep landing, and this
    # long after the last one (then prefill is probed): a cut or paused prefill costs a load this
    # plus peer_probe_s, not the transfer's timeout
    push_wait_s: float = 3.0
    # decode: after pushed KV stalled, how long prefill has to answer a probe before decode takes it
    # for gone (a partition, a paused host) and recomputes instead of fetching from it till the timeout
    peer_probe_s: float = 2.0
    # decode: memory for KV pushed before decode has admitted the request
    staging_bytes: int = 1 << 30
    # decode: of that, what one pushing peer may hold (None: half of staging_bytes), so one that
    # floods it cannot take it from the others
    staging_peer_bytes: int | None = None
    # device KV (GPU) over a host transport (tcp, shm): pinned host memory its blocks pass through
    # (prefill holds a request's KV there until decode releases it; decode lands its reads there)
    host_staging_bytes: int = 1 << 30
    # verify a checksum of every block (CRC32C, computed while the bytes are copied); length is always
    # verified. With a deployment secret and no TLS, blocks an outsider could write get a check keyed
    # by the session instead (transport/checksum.py)
    checksum: bool = True
    # settings of the KV block store (validated by vllm_pd.connector.store); None = no store
    store: dict[str, Any] | None = None
    # the deployment secret, loaded from secret_file or VLLM_PD_SECRET (not a key of its own)
    secret: DeploymentSecret | None = field(default=None, repr=False, compare=False, metadata={"loaded": True})
    # the TLS settings, from tls_cert / tls_key / tls_ca (not a key of its own)
    tls: TlsSettings | None = field(default=None, compare=False, metadata={"loaded": True})

    def __post_init__(self) -> None:
        object.__setattr__(self, "bind_host", _listen_host(self.bind_host, self.secret, self.insecure_network))

    @property
    def staging_peer_limit(self) -> int:
        """What one pushing peer may hold of the staging."""
        return self.staging_bytes // 2 if self.staging_peer_bytes is None else self.staging_peer_bytes

    @property
    def insecure(self) -> bool:
        """Listening beyond loopback without a secret (allowed by insecure_network: warn about it)."""
        return self.secret is None and not is_loopback(self.bind_host)

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> PDConnectorConfig:
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls) if not f.metadata.get("loaded")}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ConfigError(
                f"kv_connector_extra_config: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"known keys: {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = {}
        for key, value in extra.items():
            values[key] = _coerce(key, known[key].type, value)
        values["secret"] = load_secret(values.get("secret_file"), "kv_connector_extra_config.secret_file")
        values["tls"] = TlsSettings.from_keys(
            values.get("tls_cert"), values.get("tls_key"), values.get("tls_ca"), "kv_connector_extra_config."
        )
        if values["tls"] is not None and values.get("transport", "tcp") != "tcp":
            raise ConfigError(
                "kv_connector_extra_config.tls_cert: TLS is for the tcp transport (shm never leaves "
                "the host; nixl's RDMA cannot be encrypted by us: see docs/guides/security.md)"
            )
        cfg = cls(**values)
        for key in ("lease_s", "transfer_timeout_s", "push_wait_s", "peer_probe_s"):
            if getattr(cfg, key) <= 0:
                raise ConfigError(f"kv_connector_extra_config.{key}: must be > 0, got {getattr(cfg, key)!r}")
        return cfg


def needs_layer_hooks(config: PDConnectorConfig) -> bool:
    """Whether an instance with these settings may do work inside its forward, between layers,
    that must run for its KV to be right - so a replayed FULL CUDA graph, which runs no Python
    between layers, must not be used (PIECEWISE graphs call the hooks):

    * a layer-wise load (``load_mode`` ``auto`` or ``layerwise``): the forward's
      ``wait_for_layer_load`` orders each layer's attention after that layer landed;
    * the store's loads, always layer-wise.

    Not prefill's per-layer pushes: in a step replayed as a FULL graph they leave from
    ``wait_for_save``, after the forward (kv_sender.py). So a decode instance that loads whole
    requests before its step (``load_mode: async``, no store) keeps FULL graphs, whatever its
    role; the scheduler then never chooses a layer-wise load, even when a request asks for one.
    vLLM asks this before it knows the role (``requires_piecewise_for_cudagraph`` gets only
    ``kv_connector_extra_config``), hence a decision from the settings alone."""
    return config.load_mode != "async" or config.store is not None


def _listen_host(bind_host: str, secret: DeploymentSecret | None, insecure_network: bool) -> str:
    """The address the KV endpoint binds to: loopback unless a secret (or insecure_network) allows more."""
    if bind_host == "auto":
        return "0.0.0.0" if secret is not None or insecure_network else "127.0.0.1"
    check_bind(
        bind_host,
        secret,
        insecure_network,
        "kv_connector_extra_config.bind_host",
        "kv_connector_extra_config.insecure_network",
    )
    return bind_host


def _coerce(key: str, type_name: Any, value: object) -> Any:
    literal = {"TransferMode": TransferMode, "LoadMode": LoadMode, "TransportName": TransportName}.get(str(type_name))
    if literal is not None:
        choices = get_args(literal)
        if value not in choices:
            raise ConfigError(f"kv_connector_extra_config.{key}: {value!r} is not one of {list(choices)}")
        return value
    if key == "store":
        if value is not None and not isinstance(value, dict):
            raise ConfigError(f"kv_connector_extra_config.{key}: expected an object, got {value!r}")
        return value
    if key in ("secret_file", "tls_cert", "tls_key", "tls_ca"):
        if not isinstance(value, str) or not value:
            raise ConfigError(f"kv_connector_extra_config.{key}: expected a file path, got {value!r}")
        return value
    if key in ("staging_bytes", "host_staging_bytes", "staging_peer_bytes"):
        return parse_size(f"kv_connector_extra_config.{key}", value)
    if type_name == "bool":
        if not isinstance(value, bool):
            raise ConfigError(f"kv_connector_extra_config.{key}: expected true/false, got {value!r}")
        return value
    if type_name == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"kv_connector_extra_config.{key}: expected a number, got {value!r}")
        return float(value)
    if type_name == "str":
        if not isinstance(value, str) or not value:
            raise ConfigError(f"kv_connector_extra_config.{key}: expected a non-empty string, got {value!r}")
        return value
    raise ConfigError(f"kv_connector_extra_config.{key}: unsupported setting")  # pragma: no cover
