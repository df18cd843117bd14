"""transformers decoder layers under remat: their key/value cache is not appended to twice.

HF causal LMs default to ``use_cache=True``: each decoder layer appends its keys and values to
a ``DynamicCache``. Replaying a layer in backward would append them again (the recompute then
sees twice the keys and fails, or, with SDPA's causal flag, silently attends to the copies).
torch_remat runs recomputed units without the cache, as HF's own checkpointing does.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_remat as tr

transformers = pytest.importorskip("transformers")


def _tiny_llama(attn: str) -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # left padding: an explicit mask, whose width the doubled keys break
    return {"input_ids": ids, "attention_mask": mask, "labels": ids}


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_remat_units_run_without_the_kv_cache_and_match_the_plain_gradients(attn):
    model, batch = _tiny_llama(attn), _batch()
    model(**batch).loss.backward()  # no remat, cache on (HF's default)
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    for policy in (tr.Full(), tr.Selective(), tr.Selective(save=("matmul",), matmul_every=2)):
        model.zero_grad()
        tr.apply(model, policy)  # units: the decoder layers (model.model.layers.*)
        with pytest.warns(UserWarning, match="key/value cache .*use_cache=False"):
            out = model(**batch)
        out.loss.backward()
        # the cache the model built was never filled: nothing to append to in the recompute
        assert out.past_key_values.get_seq_length() == 0
        for n, p in model.named_parameters():  # the same ops recomputed: bitwise
            assert torch.equal(p.grad, want[n]), (attn, policy, n)
        tr.remove(model)
    # asked for no cache, nothing to say
    tr.apply(model, tr.Full())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(**batch, use_cache=False).loss.backward()
    # without autograd nothing is recomputed: the cache fills as usual (evaluation, decoding)
    with torch.no_grad():
        assert model(**batch).past_key_values.get_seq_length() == 16


def test_measure_and_plan_take_keyword_inputs_and_the_loss_the_model_returns():
    model, batch = _tiny_llama("sdpa"), _batch()
    step = {"kwargs": {**batch, "use_cache": False}, "loss_fn": lambda out: out.loss}
    plain = tr.measure(model, **step, steps=1, warmup=0)
    plan = tr.plan(model, (), 0.5, sample_kwargs=step["kwargs"])
    tr.apply(model, plan.policies)
    planned = tr.measure(model, **step, steps=1, warmup=0)
    tr.remove(model)
    tr.apply(model, tr.Full())
    full = tr.measure(model, **step, steps=1, warmup=0)
    assert full.saved_bytes < planned.saved_bytes <= plan.budget_bytes < plain.saved_bytes
    assert planned.saved_bytes == plan.planned_bytes  # the planner's prediction, exactly
    assert all(p.grad is None for p in model.parameters())  # measure leaves .grad as it was
    with pytest.raises(TypeError, match="inputs must be a tuple or list"):
        tr.measure(model, batch["input_ids"])
    with pytest.raises(TypeError, match="inputs must be a tuple or list"):
        tr.measure(model, batch)
