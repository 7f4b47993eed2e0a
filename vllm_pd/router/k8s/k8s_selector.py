"""Kubernetes label selectors (``app=vllm,role!=decode,tier in (a,b),!canary``): parsed and matched.

The API server does the selecting; the proxy parses a selector at start-up so
a typo stops it there (naming the flag) instead of failing every LIST later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vllm_pd.errors import ConfigError

# a label key: optional DNS-subdomain prefix and "/", then a name of at most 63 characters
_KEY = r"(?:[a-z0-9](?:[-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?"
_EQUALITY = re.compile(rf"\s*({_KEY})\s*(==|=|!=)\s*({_VALUE})\s*")
_SET = re.compile(rf"\s*({_KEY})\s+(in|notin)\s*\(([^()]*)\)\s*")
_EXISTS = re.compile(rf"\s*(!?)\s*({_KEY})\s*")
_VALUE_ONLY = re.compile(rf"\s*({_VALUE})\s*")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "in" | "notin" | "exists" | "!exists" ("=" is "in" of one value)
    values: frozenset[str] = frozenset()

    def matches(self, labels: dict[str, str]) -> bool:
        if self.op == "exists":
            return self.key in labels
        if self.op == "!exists":
            return self.key not in labels
        inside = labels.get(self.key) in self.values
        return inside if self.op == "in" else not inside


def parse_selector(text: str) -> list[Requirement]:
    """The requirements of ``text`` (all must hold); ValueError says which part is wrong."""
    if not text.strip():
        raise ConfigError("empty label selector (it would select every pod)")
    return [_requirement(part) for part in _split(text)]


def _split(text: str) -> list[str]:
    """Commas separate requirements, except inside ``in (a,b)``."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _requirement(part: str) -> Requirement:
    if m := _EQUALITY.fullmatch(part):
        return Requirement(m[1], "notin" if m[2] == "!=" else "in", frozenset([m[3]]))
    if m := _SET.fullmatch(part):
        values = [_VALUE_ONLY.fullmatch(v) for v in m[3].split(",")]
        if all(values):
            return Requirement(m[1], m[2], frozenset(v[1] for v in values if v))
    elif m := _EXISTS.fullmatch(part):
        return Requirement(m[2], "!exists" if m[1] else "exists")
    raise ConfigError(
        f"{part.strip()!r} is not a label requirement (key=value, key!=value, key in (a,b), "
        "key notin (a,b), key or !key)"
    )
