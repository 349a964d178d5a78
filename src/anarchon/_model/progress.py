"""A run's progress (``Run.save_progress``): JSON text of a bounded size, kept in the store
for the slot's next attempt."""

from __future__ import annotations

import json
from typing import Any

from .._errors import InvalidOptionError

__all__ = ["PROGRESS_BYTES_MAX", "encode_progress"]

#: The most bytes a run's progress takes, encoded: a record of where the work is (an
#: offset, a cursor, the ids done), not the work's data.
PROGRESS_BYTES_MAX = 64 * 1024


def encode_progress(value: Any) -> str:
    """``value`` as the JSON text the store keeps; ``InvalidOptionError`` for a value
    JSON cannot hold, or one longer than ``PROGRESS_BYTES_MAX`` encoded."""
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(
            f"save_progress takes what JSON holds (dicts, lists, text, numbers, True, "
            f"False, None), got {type(value).__name__}: {exc}"
        ) from None
    size = len(text.encode("utf-8"))
    if size > PROGRESS_BYTES_MAX:
        raise InvalidOptionError(
            f"a run's progress takes at most {PROGRESS_BYTES_MAX:,} bytes as JSON, got "
            f"{size:,}: keep where the work is (an offset, a cursor), not the work itself"
        )
    return text
