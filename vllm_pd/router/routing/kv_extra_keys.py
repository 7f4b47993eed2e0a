"""A request's extra keys as far as the proxy can name them: its LoRA adapter and cache salt.

vLLM keys a block's KV - in its prefix cache, and so in our store (protocol/block_keys.py) -
on the block's tokens *and* on the request's LoRA adapter (name and path), its ``cache_salt``
and its multimodal inputs. The proxy sees ``model`` (an adapter is served under its own model
name) and ``cache_salt`` in the body; the adapter's path, which vLLM hashes too, comes from
the instances' ``/v1/models`` (an adapter's card has a ``parent`` and its path as ``root``;
health.py reads the cards). Multimodal inputs are hashed by vLLM's processor over the decoded
media, which the proxy cannot reproduce: such requests get no blocks at all (prompt_tokens.py).

Where the proxy cannot name the extra keys exactly - a model it knows neither as a base model
nor as an adapter (an adapter loaded after the instance's cards were read, or before any
health check answered), a ``cache_salt`` that is not a string - it claims no hit: the request
is routed by load alone. Whatever it does claim is exact: the hashes and store keys it looks
up carry the adapter and salt, so they only match blocks computed for them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, RequestExtraKeys
from vllm_pd.router.pool.instance_pool import Instance
from vllm_pd.router.request.request_body import ParsedRequest


@dataclass(frozen=True)
class ServedModels:
    """Model names the instances serve: base models, and adapters with the path vLLM hashes."""

    base: frozenset[str]
    adapters: dict[str, str]  # adapter name -> its path (a card's ``root``)

    @classmethod
    def of(cls, instances: Iterable[Instance]) -> ServedModels:
        adapters: dict[str, str] = {}
        names: set[str] = set()
        for inst in sorted(instances, key=lambda i: i.url):  # the same answer whatever the pool's order
            names.update(inst.models)
            for name, path in inst.adapters.items():
                adapters.setdefault(name, path)
        return cls(frozenset(names - adapters.keys()), adapters)


def request_extra_keys(req: ParsedRequest, served: ServedModels) -> RequestExtraKeys | None:
    """The request's extra keys, or None where the proxy cannot name them exactly."""
    salt = req.body.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        return None  # vLLM refuses it; nothing to route by
    lora = None
    if req.model is not None:  # vLLM serves a request without a model by its base model
        if req.model in served.adapters:
            lora = (req.model, served.adapters[req.model])
        elif req.model not in served.base:
            return None
    if lora is None and not salt:
        return NO_EXTRA_KEYS
    return RequestExtraKeys(lora=lora, cache_salt=salt or None)
