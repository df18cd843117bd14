"""torch_remat on units where transformers' own gradient checkpointing is also on: a warning,
or a ValueError with ``on_hf_checkpointing="raise"``.

The nesting used to pass silently (TRL turns HF gradient checkpointing on by default). The
tests also check what the warning claims: under HF's (non-reentrant) checkpointing a Selective
policy's saved bytes buy no recompute, and with ``use_reentrant=True`` a layer runs three times.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_remat as tr

transformers = pytest.importorskip("transformers")


def _tiny_llama() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _mlp_runs_per_step(model: transformers.LlamaForCausalLM) -> int:
    """Forward runs of layer 0's MLP in one training step (original + recomputes). A pre-hook:
    a non-reentrant recompute stops at the last saved tensor, inside the MLP."""
    runs = []
    h = model.model.layers[0].mlp.register_forward_pre_hook(lambda *_: runs.append(1))
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    h.remove()
    return len(runs)


def _saved_bytes(model: transformers.LlamaForCausalLM) -> int:
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1))
    kw = {"input_ids": ids, "labels": ids, "use_cache": False}
    return tr.measure(model, kwargs=kw, loss_fn=lambda o: o.loss, steps=1, warmup=0).saved_bytes


def test_remat_on_layers_with_hf_checkpointing_warns_at_apply():
    model = _tiny_llama()
    model.train()
    model.activation_checkpointing_enable()  # non-reentrant, transformers' default
    hf_runs, hf_saved = _mlp_runs_per_step(model), _saved_bytes(model)
    assert hf_runs == 2  # forward + transformers' recompute
    with pytest.warns(UserWarning, match=r"gradient checkpointing is also on .*model\.layers\.0"):
        tr.apply(model, tr.Selective())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per apply: the steps stay quiet
        # what the warning says: Selective keeps more bytes, and the layer is recomputed anyway
        assert _saved_bytes(model) > hf_saved
        assert _mlp_runs_per_step(model) == hf_runs


def test_remat_full_inside_reentrant_hf_checkpointing_runs_layers_three_times():
    model = _tiny_llama()
    model.train()
    model.activation_checkpointing_enable({"use_reentrant": True})
    with pytest.warns(UserWarning, match="use_reentrant=True the unit's forward runs three"):
        tr.apply(model, tr.Full())
    assert _mlp_runs_per_step(model) == 3


def test_hf_checkpointing_turned_on_after_apply_warns_at_the_next_training_forward():
    # A Trainer enables HF checkpointing inside train(), after the user applied remat.
    model = _tiny_llama()
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr.apply(model, tr.Selective())
        assert _mlp_runs_per_step(model) == 2  # remat alone
        model.eval()
        model.activation_checkpointing_enable()  # off in eval / no_grad: nothing nests
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    model.train()
    with pytest.warns(UserWarning, match="gradient checkpointing is also on"):
        _mlp_runs_per_step(model)


def test_on_hf_checkpointing_raise_refuses_at_apply_and_at_forward():
    model = _tiny_llama()
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing is also on"):
        tr.apply(model, tr.Full(), on_hf_checkpointing="raise")
    assert not any(hasattr(m, "_torch_remat_policy") for m in model.modules())  # nothing applied
    model.activation_checkpointing_disable()
    tr.apply(model, tr.Full(), on_hf_checkpointing="raise")
    model.train()
    model.activation_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing is also on"):
        _mlp_runs_per_step(model)


def test_on_hf_checkpointing_must_be_warn_or_raise():
    with pytest.raises(ValueError, match=r"on_hf_checkpointing must be one of .*'ignore'"):
        tr.apply(_tiny_llama(), tr.Full(), on_hf_checkpointing="ignore")
