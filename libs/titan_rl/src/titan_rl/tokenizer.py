"""What titan_rl needs from a tokenizer (a protocol: the app's tokenizers fit it as they are)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """Text to ids and back, plus the special ids rollouts use."""

    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]:
        """Ids of ``text`` without special tokens."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens dropped."""
        ...
