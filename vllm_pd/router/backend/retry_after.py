"""A backend's ``Retry-After`` header (RFC 9110: delay-seconds or an HTTP-date) as seconds from now."""

from __future__ import annotations

import math
import time
from email.utils import parsedate_to_datetime


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """Seconds the header asks to wait (>= 0), or None when absent or unreadable; ``now``: time.time()."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(int(value))
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT
        return None
    wait = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, wait) if math.isfinite(wait) else None


def header_value(seconds: float) -> str:
    """What the proxy sends as its own Retry-After: whole seconds, at least 1."""
    return str(max(1, math.ceil(seconds)))
