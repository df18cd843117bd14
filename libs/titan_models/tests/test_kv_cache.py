"""Incremental decoding with the KV cache reproduces the full forward pass."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import titan_models


def _model(family: str, **overrides) -> titan_models.Transformer:
    cls, config = titan_models.get_model(family, "debug", num_layers=2, vocab_size=512, **overrides)
    with torch.device("meta"):
        model = cls(config)
    return model.init_weights(device="cpu", seed=3).eval()


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_cached_decoding_matches_full_forward_for_ragged_prompts(family):
    model = _model(family)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 9)]
    new_tokens, step_logits = titan_models.greedy_generate(model, prompts, max_new_tokens=32)
    assert new_tokens.shape == (3, 32)

    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            full = torch.tensor(prompt + new_tokens[row].tolist())[None]
            logits = model(full)[0]
            # Logits at the last prompt position and at every generated token but the last.
            expected = logits[len(prompt) - 1 : len(prompt) - 1 + 32]
            diff = (step_logits[row] - expected).abs().max().item()
            assert diff <= 1e-5, f"row {row}: cached decoding differs by {diff}"


def test_chunked_prefill_equals_one_prefill():
    model = _model("llama3")
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(2, 32)
        chunks = [model(part, kv_cache=cache) for part in tokens.split([10, 1, 13], dim=1)]
    assert torch.allclose(torch.cat(chunks, dim=1), full, atol=1e-5, rtol=0)
    assert cache.lengths.tolist() == [24, 24]


def test_cache_overflow_is_refused_before_any_write():
    model = _model("qwen3")
    cache = model.new_kv_cache(1, 8)
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), kv_cache=cache)
        before = cache.layers[0].k_BKLD.clone()
        with pytest.raises(ValueError, match="max_seq_len=8"):
            model(torch.zeros(1, 3, dtype=torch.long), kv_cache=cache)
    assert torch.equal(cache.layers[0].k_BKLD, before)
    assert cache.lengths.tolist() == [6]


@pytest.mark.parametrize(
    ("lengths", "match"),
    [([0, 3], r"input_lengths must lie in \[1, 3\]"), ([4, 3], r"\[1, 3\]"), ([1], "shape")],
)
def test_bad_input_lengths_are_refused(lengths, match):
    model = _model("llama3")
    cache = model.new_kv_cache(2, 8)
    with pytest.raises(ValueError, match=match):
        model(
            torch.zeros(2, 3, dtype=torch.long), kv_cache=cache, input_lengths=torch.tensor(lengths)
        )


def test_input_lengths_without_a_cache_are_refused():
    model = _model("llama3")
    with pytest.raises(ValueError, match="needs a kv_cache"):
        model(torch.zeros(2, 3, dtype=torch.long), input_lengths=torch.tensor([3, 3]))


def test_cache_batch_must_match_the_input():
    model = _model("llama3")
    with pytest.raises(ValueError, match="batch_size=3"):
        model(torch.zeros(2, 3, dtype=torch.long), kv_cache=model.new_kv_cache(3, 8))


def _windowed(family: str = "qwen3", **overrides) -> titan_models.Transformer:
    # Layer 1 slides over 6 tokens: its cache is a ring of 5 (+1 scratch slot).
    return _model(family, sliding_window=6, sliding_window_layers=(1,), **overrides)


def test_sliding_window_layer_keeps_a_ring_and_decodes_like_the_full_forward():
    model = _windowed()
    cache = model.new_kv_cache(3, 64)
    assert cache.layers[0].k_BKLD.shape[2] == 64 and cache.layers[1].k_BKLD.shape[2] == 6
    assert cache.bytes_per_token() == 2 * 4 * 64 * 4  # the full layer only: K and V, fp32
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 17, 9)]
    new_tokens, step_logits = titan_models.greedy_generate(model, prompts, max_new_tokens=20)
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            logits = model(torch.tensor(prompt + new_tokens[row].tolist())[None])[0]
            expected = logits[len(prompt) - 1 : len(prompt) - 1 + 20]
            assert (step_logits[row] - expected).abs().max().item() <= 1e-5, row


def test_chunked_prefill_through_a_ring_equals_one_prefill():
    model = _windowed("llama3")
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_kv_cache(2, 32)
        chunks = [model(part, kv_cache=cache) for part in tokens.split([10, 1, 3, 10], dim=1)]
    assert (torch.cat(chunks, dim=1) - full).abs().max().item() <= 1e-5


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_prefill_with_documents_then_decode_continues_the_last_document(backend):
    # Row 0 packs documents of 5 and 7 tokens, row 1 of 9 and 3; then 6 tokens are decoded one
    # at a time. The reference is one forward over each whole row with its document ids.
    model = _windowed(attention_backend=backend)
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 512, (2, 12 + 6), generator=g)
    ids = torch.tensor([[0] * 5 + [1] * 13, [4] * 9 + [7] * 9])
    with torch.no_grad():
        expected = model(tokens, document_ids=ids)
        cache = model.new_kv_cache(2, 24)
        steps = [model(tokens[:, :12], kv_cache=cache, document_ids=ids[:, :12])]
        steps += [model(tokens[:, t : t + 1], kv_cache=cache) for t in range(12, 18)]
    assert (torch.cat(steps, dim=1) - expected).abs().max().item() <= 1e-5


def test_documents_in_a_cache_step_must_not_go_back():
    model = _model("llama3")
    cache = model.new_kv_cache(1, 16)
    with torch.no_grad():
        model(
            torch.zeros(1, 4, dtype=torch.long),
            kv_cache=cache,
            document_ids=torch.tensor([[3] * 4]),
        )
        with pytest.raises(ValueError, match="non-decreasing along each row"):
            model(
                torch.zeros(1, 2, dtype=torch.long),
                kv_cache=cache,
                document_ids=torch.tensor([[2, 2]]),
            )


class _HostReads(TorchDispatchMode):
    """Counts the ops that read device data back to the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name in ("aten::_local_scalar_dense", "aten::is_nonzero")
        return func(*args, **(kwargs or {}))


def test_static_cache_decodes_like_the_dynamic_one_with_fixed_shapes_and_no_host_reads():
    """``static=True`` (what a compiled or CUDA-graph decode step needs): each step attends to
    the whole capacity, full layers and ring alike, reads nothing back to the host, and gives
    the dynamic cache's logits. Writing past the capacity is a device-side assert."""
    model = _windowed("llama3")
    g = torch.Generator().manual_seed(0)
    prompt_BP = torch.randint(0, 512, (3, 9), generator=g)
    lengths_B = torch.tensor([9, 4, 7])
    dynamic, static = model.new_kv_cache(3, 24), model.new_kv_cache(3, 24, static=True)
    with torch.no_grad():
        want = model(prompt_BP, kv_cache=dynamic, input_lengths=lengths_B)
        got = model(prompt_BP, kv_cache=static, input_lengths=lengths_B)
        assert (got - want).abs().max().item() <= 1e-5
        next_B1 = want[torch.arange(3), lengths_B - 1].argmax(-1, keepdim=True)
        steps, begin = [], static.begin
        static.begin = lambda *a, **kw: steps.append(begin(*a, **kw)) or steps[-1]
        for _ in range(12):
            want = model(next_B1, kv_cache=dynamic)
            with _HostReads() as reads:
                got = model(next_B1, kv_cache=static)
            assert reads.count == 0
            assert (got - want).abs().max().item() <= 1e-5
            next_B1 = want[:, -1].argmax(-1, keepdim=True)
        with _HostReads() as reads:
            model(next_B1, kv_cache=dynamic)
        assert reads.count > 0  # the dynamic cache bounds its keys with one host read
        assert {(s.kv_len, s.reads_cache) for s in steps} == {(24, True)}
        assert static.lengths.tolist() == (lengths_B + 12).tolist()
        with pytest.raises(RuntimeError, match="max_seq_len=24"):
            model(torch.zeros(3, 4, dtype=torch.long), kv_cache=static)
