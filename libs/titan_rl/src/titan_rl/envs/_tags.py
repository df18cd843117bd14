"""The tag format tool environments share: ``<name>argument</name>`` in an assistant turn."""

from __future__ import annotations

import re


def find_tag(text: str, name: str) -> str | None:
    """The content of the first complete ``<name>...</name>`` in ``text``, else ``None``."""
    found = re.search(rf"<{name}>(.*?)</{name}>", text, re.DOTALL)
    return None if found is None else found.group(1)
