"""Shared fixtures: a byte tokenizer and a tiny random Llama 3 on the byte vocabulary."""

from __future__ import annotations

import pytest
import torch

import titan_models


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS 256, EOS 257, PAD 258 (the app's ids); vocab 264."""

    bos_id, eos_id, pad_id, vocab_size = 256, 257, 258, 264

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


@pytest.fixture
def tokenizer() -> ByteTokenizer:
    return ByteTokenizer()


def make_model(seed: int = 0, family: str = "llama3", **overrides) -> torch.nn.Module:
    """``family``'s debug flavour on the byte vocabulary, 2 layers unless overridden."""
    cfg = {"vocab_size": 264, "num_layers": 2, **overrides}
    model_cls, config = titan_models.get_model(family, "debug", **cfg)
    with torch.device("meta"):
        model = model_cls(config)
    return model.init_weights(device="cpu", seed=seed)


@pytest.fixture
def tiny_model() -> torch.nn.Module:
    return make_model()


@pytest.fixture
def model_factory():
    """``make_model`` for tests that need several models."""
    return make_model


@pytest.fixture
def single_thread():
    """One intra-op thread: these tiny models gain nothing from two, and a shared machine
    makes two-thread OpenMP barriers slow by 10x; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
