"""Every prompt the end-to-end tests compare against the plain instance.

The plain (reference) instance runs once, alone, over this whole catalogue
before any disaggregated instance starts; tests look their expected output up
by key. Token-id prompts give exact lengths around block boundaries (128).
"""

from __future__ import annotations

import random
from typing import Any

from tests.e2e_cluster import MAX_MODEL_LEN, MAX_TOKENS, chat_body, completion_body

_rng = random.Random(20261121)


def _ids(n: int) -> list[int]:
    return [_rng.randrange(5, 4000) for _ in range(n)]  # 0-4 are special tokens


TOKEN_LENGTHS = (1, 2, 17, 100, 127, 128, 129, 255, 256, 300, 512, 640, 1000, 1500,
                 MAX_MODEL_LEN - MAX_TOKENS - 4)
TEXTS = (
    "hello",
    "the prefill instance computes the prompt and the decode instance",
    "one two three four five six seven eight nine ten " * 20,
    "Explain why the cache block key is a chained hash of the token ids. " * 9,
    "red green blue cat dog house tree river city story " * 40,
)
CHATS = (
    "hi",
    "tell me a story about a small model and a large router",
    "what is the latency of a request when the prompt is long? " * 12,
    "write a kernel for attention. " * 30,
)

CONNECTOR_CASES: dict[str, dict[str, Any]] = {}
for n in TOKEN_LENGTHS:
    CONNECTOR_CASES[f"ids{n}"] = completion_body(_ids(n))
for i, t in enumerate(TEXTS):
    CONNECTOR_CASES[f"text{i}"] = completion_body(t)
for i, t in enumerate(CHATS):
    CONNECTOR_CASES[f"chat{i}"] = chat_body(t)

# Other areas add their own dicts here; the reference phase runs all of them.
CATALOGUE: dict[str, dict[str, Any]] = {**CONNECTOR_CASES}
