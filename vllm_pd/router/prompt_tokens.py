"""A request's prompt as vLLM will see it: token ids, and vLLM's prefix-cache block hashes.

The proxy never imports torch or vLLM: the model's own ``tokenizer.json`` is
loaded with HF ``tokenizers`` (Rust) and chat templates are rendered with
jinja2 the way transformers' ``apply_chat_template`` does (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``add_generation_prompt``). vLLM then
tokenizes a rendered chat prompt without special tokens and a completion
prompt with them (both overridable by ``add_special_tokens`` in the body).

Block hashes follow ``vllm.v1.core.kv_cache_utils.hash_block_tokens``:
``h[i] = H((h[i-1], tuple(block_i), extra_i))`` with ``h[-1] = NONE_HASH =
H(seed)``; ``H`` is vLLM's ``--prefix-caching-hash-algo``: ``sha256`` (pickle,
vLLM 0.32's default) or ``sha256_cbor``. The seed is ``PYTHONHASHSEED`` when
set, else vLLM's fixed ``"vllm-none-hash"``: with both algorithms the hashes
are the same in every process, so the servers and the proxy must simply agree
on the algorithm and on PYTHONHASHSEED. (The xxhash algorithms seed randomly
per process unless PYTHONHASHSEED is set; they are not supported here.)
``extra_i`` are block i's extra keys (the LoRA adapter, the cache salt on
block 0), as kv_extra_keys.py derives them from the body: the same tuples
vLLM hashes, so the proxy's hashes (and the store keys, store_locations.py)
of an adapter's or a salted request are the instances' own.

Anything this module cannot reproduce exactly (images and other multimodal
parts, tools, a custom template, a model the proxy does not know as a base
model or an adapter) yields no blocks: the request is then routed by load
alone, never claimed as a hit - a routing miss only costs a recompute.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_pd.connector.store.keys import NO_EXTRA_KEYS, BlockExtraKeys, RequestExtraKeys
from vllm_pd.router.request_body import CHAT, ParsedRequest
from vllm_pd.errors import ConfigError

logger = logging.getLogger(__name__)

HASH_ALGOS = ("sha256", "sha256_cbor")
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED
# body fields that change the rendered prompt in ways not reproduced here: no blocks for such requests
_UNSUPPORTED_CHAT_FIELDS = ("chat_template", "chat_template_kwargs", "tools", "documents",
                            "mm_processor_kwargs", "truncate_prompt_tokens")
_UNSUPPORTED_COMPLETION_FIELDS = ("truncate_prompt_tokens", "prompt_embeds", "lora_request")

BlockHash = int  # the low 64 bits of vLLM's block hash (what VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES publishes)


def external_hash(h: bytes | int) -> BlockHash:
    """vLLM's hash in the form the index keys on, whether an event carried bytes or an int
    (``maybe_convert_block_hash``: big-endian, low 64 bits)."""
    if isinstance(h, int):
        return h & ((1 << 64) - 1)
    return int.from_bytes(h[-8:], "big")


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # a vLLM dependency; only this algorithm needs it

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


class VllmBlockHasher:
    """vLLM's prefix-cache block hashes of a token sequence (full blocks only)."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in HASH_ALGOS:
            raise ConfigError(f"kv_hash_algo: {algo!r} is not one of {HASH_ALGOS}")
        self.algo = algo
        self._fn: Callable[[Any], bytes] = _sha256_pickle if algo == "sha256" else _sha256_cbor
        self.seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)
        self.none_hash = self._fn(self.seed)

    def hashes(self, token_ids: Sequence[int], block_size: int, parent: bytes | None = None,
               extra_keys: Sequence[BlockExtraKeys] | None = None) -> list[bytes]:
        """Full vLLM hashes (bytes) of each full block; ``parent`` continues a chain;
        ``extra_keys[i]``: block i's extra keys (None: no block has any)."""
        out: list[bytes] = []
        prev = parent if parent else self.none_hash
        for i, start in enumerate(range(0, len(token_ids) // block_size * block_size, block_size)):
            extra = extra_keys[i] if extra_keys is not None else None
            prev = self._fn((prev, tuple(token_ids[start:start + block_size]), extra))
            out.append(prev)
        return out


@dataclass
class PromptBlocks:
    """One request's prompt tokens, its extra keys and, per block size asked for, its block hashes."""

    token_ids: list[int]
    hasher: VllmBlockHasher
    _by_size: dict[int, list[BlockHash]]
    extra_keys: RequestExtraKeys = NO_EXTRA_KEYS

    def hashes(self, block_size: int) -> list[BlockHash]:
        got = self._by_size.get(block_size)
        if got is None:
            n = len(self.token_ids) // block_size
            extra = self.extra_keys.blocks(0, n, block_size)
            got = [external_hash(h) for h in self.hasher.hashes(self.token_ids, block_size, extra_keys=extra)]
            self._by_size[block_size] = got
        return got


class ChatTemplate:
    """A tokenizer_config.json chat template, rendered as transformers renders it."""

    def __init__(self, source: str, special: dict[str, str]) -> None:
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        self._template = env.from_string(source)
        self._special = special

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self._special)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # AddedToken form {"content": ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


class PromptTokenizer:
    """Token ids and block hashes of requests, with a bounded cache (retries, repeated prompts)."""

    def __init__(self, model_dir: str | Path, hasher: VllmBlockHasher, cache_size: int = 1024) -> None:
        from tokenizers import Tokenizer

        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"tokenizer: {path} does not exist")
        self._tok = Tokenizer.from_file(str(path))
        self.hasher = hasher
        self._template: ChatTemplate | None = None
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        source = cfg.get("chat_template")
        if isinstance(source, list):  # named templates: transformers uses "default"
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if isinstance(source, str):
            special = {k: t for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                       if (t := _token_text(cfg.get(k))) is not None}
            self._template = ChatTemplate(source, special)
        self._cache: OrderedDict[tuple[str, bytes, RequestExtraKeys], PromptBlocks | None] = OrderedDict()
        self._cache_size = cache_size

    def blocks(self, req: ParsedRequest, extra_keys: RequestExtraKeys = NO_EXTRA_KEYS) -> PromptBlocks | None:
        """The request's prompt blocks (hashed with its ``extra_keys``), or None where they cannot
        be reproduced exactly."""
        key = (req.path, req.raw, extra_keys)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        ids = self.token_ids(req)
        got = None if ids is None else PromptBlocks(ids, self.hasher, {}, extra_keys)
        self._cache[key] = got
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return got

    def token_ids(self, req: ParsedRequest) -> list[int] | None:
        try:
            return self._chat_ids(req.body) if req.path == CHAT else self._completion_ids(req.body)
        except Exception as e:  # a template that fails here fails in vLLM too; route by load
            logger.debug("prompt not tokenized (%r); routing by load", e)
            return None

    def _completion_ids(self, body: dict[str, Any]) -> list[int] | None:
        if any(body.get(k) is not None for k in _UNSUPPORTED_COMPLETION_FIELDS):
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if not isinstance(prompt, str):
            return None
        special = body.get("add_special_tokens", True)
        return self._tok.encode(prompt, add_special_tokens=bool(special)).ids

    def _chat_ids(self, body: dict[str, Any]) -> list[int] | None:
        if self._template is None or body.get("continue_final_message"):
            return None
        if any(body.get(k) is not None for k in _UNSUPPORTED_CHAT_FIELDS):
            return None
        messages = []
        for m in body.get("messages") or []:
            content = m.get("content")
            if isinstance(content, list):  # vLLM's "string" content format: text parts joined by newlines
                if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                    return None
                content = "\n".join(p.get("text", "") for p in content)
            messages.append({**m, "content": content})
        text = self._template.render(messages, bool(body.get("add_generation_prompt", True)))
        return self._tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False))).ids
