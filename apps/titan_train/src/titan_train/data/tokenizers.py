"""Tokenizers: a built-in byte-level one (nothing to download) and HF ``tokenizer.json``."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol


class Tokenizer(Protocol):
    """What the data pipeline and the RL rewards need from a tokenizer."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS, EOS and PAD; vocabulary padded to a multiple of 8."""

    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 264

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (no BOS/EOS: packing adds them)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        """Text of the byte ids; special ids are dropped, invalid UTF-8 is replaced."""
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from a local ``tokenizer.json``."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"data.tokenizer={str(path)!r}: no such tokenizer.json file")
        try:
            self._tok = _HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception types
            raise ValueError(
                f"data.tokenizer={str(path)!r} is not a Hugging Face tokenizer.json ({e})"
            ) from None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_id = self._special(("<|begin_of_text|>", "<s>", "<|endoftext|>", "<bos>"))
        self.eos_id = self._special(("<|end_of_text|>", "</s>", "<|endoftext|>", "<eos>"))
        self.pad_id = self.eos_id

    def _special(self, candidates: tuple[str, ...]) -> int:
        for token in candidates:
            i = self._tok.token_to_id(token)
            if i is not None:
                return i
        raise ValueError(
            f"tokenizer has none of the special tokens {candidates}; cannot mark documents"
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` without special tokens."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` with special tokens skipped."""
        return self._tok.decode(ids, skip_special_tokens=True)


def build_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` for the built-in tokenizer, else a path to an HF ``tokenizer.json``."""
    return ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
