"""Module and parameter names matched by glob patterns, one meaning across Titan's libraries.

A pattern is a dotted name matched segment by segment: ``*`` matches any run of characters
inside one segment (``layers.*`` is each block but nothing inside one; ``w*`` matches ``wq``),
and a segment that is exactly ``**`` matches zero or more whole segments (``layers.**`` is
``layers`` and everything under it, ``**.bias`` every bias). No other character is special.
flexshard, torch_remat and titan_models each hold this same file (they do not import one
another); ``tests/test_globs.py`` runs one table of cases through all three.
"""

from __future__ import annotations

import functools
import re

__all__ = ["fqn_matches"]


def fqn_matches(pattern: str, fqn: str) -> bool:
    """Whether the dotted name ``fqn`` matches the glob ``pattern`` (see the module doc)."""
    return _compiled(pattern).fullmatch("." + fqn) is not None


@functools.lru_cache(maxsize=4096)
def _compiled(pattern: str) -> re.Pattern[str]:
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"FQN glob must be a non-empty str, got {pattern!r}")
    parts = []
    for segment in pattern.split("."):
        if segment == "**":
            parts.append(r"(?:\.[^.]+)*")
        elif "**" in segment:
            raise ValueError(
                f"FQN glob {pattern!r}: '**' must be a whole segment (as in 'layers.**')"
            )
        else:
            parts.append(r"\." + re.escape(segment).replace(r"\*", "[^.]*"))
    return re.compile("".join(parts))
