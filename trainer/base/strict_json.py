"""JSON as the standard defines it: whatever we write, a strict parser reads.

Python's `json.dumps` writes `NaN` and `Infinity` unless told not to, and those are not
JSON: JavaScript's `JSON.parse`, Go's and Rust's decoders and `jq` refuse the whole file.
Every JSON file the project writes (manifests, pointers, configs, registrations, asset
values) goes through `dumps`: a non-finite float becomes `null` (a best score with no best
yet, a metric that overflowed) and `allow_nan=False` guards the rest. Reading stays
lenient (`json.loads` accepts `Infinity`), so files written before this still read.
"""

from __future__ import annotations

import json
import math
from typing import Any


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (at any depth) replaced by None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def dumps(obj: Any, **kwargs: Any) -> str:
    """`json.dumps` that writes strict JSON: non-finite floats as null, never NaN/Infinity."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def non_finite_path(obj: Any, path: str = "") -> str | None:
    """The dotted path of the first non-finite float in `obj` (None: there is none)."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else path
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) \
        if isinstance(obj, list | tuple) else ()
    for k, v in items:
        found = non_finite_path(v, f"{path}.{k}" if isinstance(k, str) else f"{path}[{k}]")
        if found is not None:
            return found
    return None
