"""Times in tags and messages: ISO 8601 UTC with milliseconds, readable and exact."""

from __future__ import annotations

from datetime import UTC, datetime


def iso(ts: float) -> str:
    """`2026-11-30T00:01:02.300Z`: a time in tags and messages, readable and exact."""
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


def parse_time(value: str | None) -> float | None:
    """An ISO 8601 tag value (or epoch seconds, as older runs wrote) as epoch seconds."""
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
