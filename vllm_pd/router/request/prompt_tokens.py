"""A request's prompt as vLLM will see it: its token ids, and its blocks (block_hashes.py).

The proxy never imports torch or vLLM: the model's own ``tokenizer.json`` is
loaded with HF ``tokenizers`` (Rust) and chat templates are rendered with
jinja2 the way transformers' ``apply_chat_template`` does (sandboxed,
``trim_blocks``/``lstrip_blocks``, ``add_generation_prompt``). vLLM then
tokenizes a rendered chat prompt without special tokens and a completion
prompt with them (both overridable by ``add_special_tokens`` in the body).

Anything this module cannot reproduce exactly (images and other multimodal
parts, tools, a custom template, a model the proxy does not know as a base
model or an adapter) yields no blocks: the request is then routed by load
alone, never claimed as a hit - a routing miss only costs a recompute.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from pathlib import Path
from typing import Any

from vllm_pd.errors import ConfigError
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, RequestExtraKeys
from vllm_pd.router.request.block_hashes import PromptBlocks, VllmBlockHasher
from vllm_pd.router.request.request_body import CHAT, ParsedRequest

logger = logging.getLogger(__name__)

# body fields that change the rendered prompt in ways not reproduced here: no blocks for such requests
_UNSUPPORTED_CHAT_FIELDS = (
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
    "mm_processor_kwargs",
    "truncate_prompt_tokens",
)
_UNSUPPORTED_COMPLETION_FIELDS = ("truncate_prompt_tokens", "prompt_embeds", "lora_request")


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
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **self._special)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
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
            special = {
                k: t
                for k in ("bos_token", "eos_token", "unk_token", "pad_token")
                if (t := _token_text(cfg.get(k))) is not None
            }
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
