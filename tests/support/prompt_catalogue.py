"""Every prompt the end-to-end tests compare against the plain instance.

The plain (reference) instance runs once, alone, over this whole catalogue
before any disaggregated instance starts; tests look their expected output up
by key. Token-id prompts give exact lengths around block boundaries (128).
"""

from __future__ import annotations

import random
from typing import Any

from tests.support.e2e_cluster import MAX_MODEL_LEN, MAX_TOKENS, chat_body, completion_body

_rng = random.Random(20261121)


def _ids(n: int) -> list[int]:
    return [_rng.randrange(5, 4000) for _ in range(n)]  # 0-4 are special tokens


TOKEN_LENGTHS = (1, 2, 17, 100, 127, 128, 129, 255, 256, 300, 512, 640, 1000, 1500, MAX_MODEL_LEN - MAX_TOKENS - 4)
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

# The KV block store (tests/e2e/test_store_e2e.py): multi-turn prefixes, prompts for
# memory pressure and for requests sent while the store master is killed.
_store_rng = random.Random(5)


def _store_ids(n: int) -> list[int]:
    return [_store_rng.randrange(300, 3000) for _ in range(n)]


STORE_TURN1 = _store_ids(300)
STORE_TURN2 = STORE_TURN1 + _store_ids(120)  # turn 1 + reply + next user message
STORE_OTHER = _store_ids(200)
STORE_PRESSURE = [_store_ids(300) for _ in range(4)]
STORE_LATE = [_store_ids(260) for _ in range(3)]
STORE_LATE.append(STORE_LATE[0] + _store_ids(100))
STORE_FROM_DISK = _store_ids(300)  # drawn last: the prompts above stay what they were
STORE_CASES: dict[str, dict[str, Any]] = {
    "store_turn1": completion_body(STORE_TURN1),
    "store_turn2": completion_body(STORE_TURN2),
    "store_other": completion_body(STORE_OTHER),
    **{f"store_pressure{i}": completion_body(p) for i, p in enumerate(STORE_PRESSURE)},
    **{f"store_late{i}": completion_body(p) for i, p in enumerate(STORE_LATE)},
    "store_from_disk": completion_body(STORE_FROM_DISK),
}

# The supervisor (tests/e2e/test_supervisor_e2e.py): an output-heavy load (short prompts, long outputs; these
# may repeat) and a prompt-heavy one (long prompts, 1 token out; each prompt once, so no prefix cache
# takes the prompt work away: enough of them for the phase to last until the move and its hold under a
# slow CI machine - 96 ran out there, the move unmade). Every output runs to max_tokens, so the load is
# what it says.
_sup_rng = random.Random(16)
SUPERVISOR_OUTPUT_HEAVY = {
    f"sup_out{i}": completion_body([_sup_rng.randrange(5, 4000) for _ in range(16)], max_tokens=64, ignore_eos=True)
    for i in range(12)
}
SUPERVISOR_PROMPT_HEAVY = {
    f"sup_long{i}": completion_body([_sup_rng.randrange(5, 4000) for _ in range(1200)], max_tokens=1, ignore_eos=True)
    for i in range(288)
}

# Other areas add their own dicts here; the reference phase runs all of them.
CATALOGUE: dict[str, dict[str, Any]] = {
    **CONNECTOR_CASES,
    **STORE_CASES,
    **SUPERVISOR_OUTPUT_HEAVY,
    **SUPERVISOR_PROMPT_HEAVY,
}
