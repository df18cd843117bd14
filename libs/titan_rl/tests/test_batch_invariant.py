"""Batch-invariant mode: generator log-probs equal the trainer's recompute, bit for bit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_rl import (
    SamplingParams,
    TorchGenerator,
    batch_invariant,
    invariant_attention,
    invariant_linear,
    sequence_logprobs,
)

PARAMS = SamplingParams(max_new_tokens=16, temperature=1.0, top_k=40, stop_token_ids=(257,))
SEEDS = list(range(100, 108))


def _ragged_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    lengths = [3, 11, 1, 7, 5, 9, 2, 13]
    return [[256, *torch.randint(32, 127, (n,), generator=g).tolist()] for n in lengths]


def _generate_in_batches(gen: TorchGenerator, prompts, batch_size: int):
    rows = []
    for i in range(0, len(prompts), batch_size):
        out = gen.generate(prompts[i : i + batch_size], PARAMS, SEEDS[i : i + batch_size])
        rows += [(out.tokens[j], out.mask[j], out.logprobs[j]) for j in range(len(out.tokens))]
    return rows


def _trainer_logprobs(model, prompts, rows) -> list[torch.Tensor]:
    width = max(int(m.sum()) for _, m, _ in rows)
    tokens = torch.stack(
        [torch.nn.functional.pad(t, (0, width - len(t)))[:width] for t, _, _ in rows]
    )
    mask = torch.stack(
        [torch.nn.functional.pad(m, (0, width - len(m)))[:width] for _, m, _ in rows]
    )
    with torch.no_grad():
        lp = sequence_logprobs(model, prompts, tokens, mask)
    return [lp[i, : int(mask[i].sum())] for i in range(len(rows))]


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.usefixtures("single_thread")
def test_generator_logprobs_equal_trainer_recompute_exactly(model_factory, family):
    """Batch sizes 1, 3 and 8 over ragged prompts: every sampled token's log-prob is the same
    bits in each batch size and in the trainer's full-sequence forward (also a mixed batch).
    Qwen3 adds QK-norm and a tied head."""
    tiny_model = model_factory(family=family)
    prompts = _ragged_prompts()
    gen = TorchGenerator(tiny_model, batch_invariant=True)
    by_size = {bs: _generate_in_batches(gen, prompts, bs) for bs in (1, 3, 8)}
    for bs in (3, 8):
        for (t1, m1, lp1), (t, m, lp) in zip(by_size[1], by_size[bs], strict=True):
            assert torch.equal(t1[m1], t[m]) and torch.equal(lp1[m1], lp[m])
    assert sum(int(m.sum()) for _, m, _ in by_size[8]) > 40  # enough tokens to mean something
    with batch_invariant():
        recomputed = _trainer_logprobs(tiny_model, prompts, by_size[8])
        # The trainer batch holds the rows in another order and composition: still exact.
        order = [5, 0, 7, 2]
        subset = _trainer_logprobs(
            tiny_model, [prompts[i] for i in order], [by_size[8][i] for i in order]
        )
    for (_, m, lp), lp_trainer in zip(by_size[8], recomputed, strict=True):
        assert torch.equal(lp[m], lp_trainer)
    for i, lp_trainer in zip(order, subset, strict=True):
        assert torch.equal(by_size[8][i][2][by_size[8][i][1]], lp_trainer)


def test_equal_with_two_intra_op_threads(tiny_model):
    """The same claim with two threads (the GEMMs split their work across cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        prompts = _ragged_prompts()[:4]  # two threads are slow on a shared machine: keep it small
        gen = TorchGenerator(tiny_model, batch_invariant=True)
        one, eight = _generate_in_batches(gen, prompts, 1), _generate_in_batches(gen, prompts, 4)
        with batch_invariant():
            recomputed = _trainer_logprobs(tiny_model, prompts, eight)
    finally:
        torch.set_num_threads(before)
    for (t1, m1, lp1), (t8, m8, lp8), lp_trainer in zip(one, eight, recomputed, strict=True):
        assert torch.equal(t1[m1], t8[m8]) and torch.equal(lp1[m1], lp8[m8])
        assert torch.equal(lp8[m8], lp_trainer)


@pytest.mark.usefixtures("single_thread")
def test_default_mode_reports_the_gap(tiny_model, record_property):
    """With the mode off the same comparison is not exact: the gap is measured and reported."""
    prompts = _ragged_prompts()
    gen = TorchGenerator(tiny_model, batch_invariant=False)
    rows = _generate_in_batches(gen, prompts, 8)
    recomputed = _trainer_logprobs(tiny_model, prompts, rows)
    gap = max(
        float((lp[m] - r).abs().max()) for (_, m, lp), r in zip(rows, recomputed, strict=True)
    )
    record_property("default_mode_max_abs_logprob_gap", gap)
    print(f"default mode: max |generator - trainer| log-prob = {gap:.3e}")
    assert gap < 1e-3  # same model, same weights: small, but (on this machine) not zero


def test_invariant_linear_rows_do_not_depend_on_the_batch():
    torch.manual_seed(0)
    w, x = torch.randn(96, 80), torch.randn(37, 80)
    ref = invariant_linear(x, w)
    assert torch.allclose(ref, F.linear(x, w), atol=1e-5)
    for m in (1, 2, 5, 16, 17):
        idx = torch.randperm(37)[:m]
        assert torch.equal(invariant_linear(x[idx], w), ref[idx])
    b = torch.randn(96)
    assert torch.allclose(
        invariant_linear(x.view(1, 37, 80), w, b), F.linear(x, w, b)[None], atol=1e-5
    )


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_invariant_attention_matches_sdpa(heads):
    torch.manual_seed(0)
    H, K = heads
    q, k, v = torch.randn(2, H, 70, 16), torch.randn(2, K, 70, 16), torch.randn(2, K, 70, 16)
    gqa = H != K
    ours = invariant_attention(q, k, v, is_causal=True, enable_gqa=gqa, key_block=32)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    assert torch.allclose(ours, ref, atol=1e-5)
    mask = torch.rand(2, 1, 70, 70) > 0.3
    mask[..., 0] = True  # every query sees at least one key
    ours = invariant_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=0.3)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa, scale=0.3)
    assert torch.allclose(ours, ref, atol=1e-5)


def test_mode_keeps_the_model_close_to_default_and_differentiable(tiny_model):
    tokens = torch.randint(0, 256, (3, 20))
    ref = tiny_model(tokens)
    with batch_invariant():
        out = tiny_model(tokens)
    assert torch.allclose(out, ref, atol=1e-4)
    out.sum().backward()
    assert all(p.grad is not None for p in tiny_model.parameters())


def test_bad_mode_arguments_are_refused():
    with pytest.raises(ValueError, match="row_block=0"), batch_invariant(row_block=0):
        pass
    with pytest.raises(TypeError, match="boolean mask"):
        invariant_attention(*[torch.zeros(1, 1, 2, 4)] * 3, attn_mask=torch.zeros(1, 1, 2, 2))
