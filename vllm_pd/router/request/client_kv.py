"""A client never controls the KV flow: the KV fields it sends are dropped before any leg is built.

``kv_transfer_params`` names hosts, ports, engines and transfers; a client that
set it could make prefill push KV to an address of its choosing or make decode
read another request's KV. vLLM also copies ``vllm_xargs`` into the sampling
params' ``extra_args``, where the connector reads ``kv_transfer_params``, so
that key goes from there too. The top-level names of the connector's params
(``remote_host``, ``transfer_id``, ...) are dropped as well: vLLM ignores them
today, and nothing a client sends should read as a transfer.

Every leg (prefill, decode, decode-only fallback, short prompts, ``n > 1``,
retries) is built from the parsed body and its bytes, so stripping both once at
parse time covers them all.
"""

from __future__ import annotations

from typing import Any

KV_PARAMS = "kv_transfer_params"
_XARGS = "vllm_xargs"

# the connector's wire names (vllm_pd.protocol.transfer_params) and NixlConnector's
CLIENT_KV_FIELDS = frozenset(
    {
        KV_PARAMS,
        "do_remote_decode",
        "do_remote_prefill",
        "remote_engine_id",
        "remote_block_ids",
        "remote_host",
        "remote_port",
        "remote_request_id",
        "remote_endpoint",
        "remote_endpoints",
        "remote_num_tokens",
        "tp_size",
        "prompt_hash",
        "transfer_id",
        "transfer_mode",
        "decode_endpoint",
        "transfer_key",  # protocol 1's name of the transfer
        "store_fetch",  # where a prefill's store fetches the prompt from: a client must not point it anywhere
    }
)


def strip_client_kv(body: dict[str, Any]) -> bool:
    """Remove every KV field a client put in ``body`` (in place); True when something was removed."""
    removed = False
    if not CLIENT_KV_FIELDS.isdisjoint(body.keys()):
        for key in CLIENT_KV_FIELDS.intersection(body.keys()):
            del body[key]
        removed = True
    xargs = body.get(_XARGS)
    if isinstance(xargs, dict) and KV_PARAMS in xargs:
        body[_XARGS] = {k: v for k, v in xargs.items() if k != KV_PARAMS}
        removed = True
    return removed
