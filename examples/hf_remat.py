"""torch_remat policies on a Hugging Face Llama: the same loss and gradients, fewer saved bytes.

    python examples/hf_remat.py

A tiny random ``LlamaForCausalLM`` built from a config (nothing is downloaded) trains a few
AdamW steps in a plain loop with its decoder layers under ``Selective``, after ``measure``
and ``plan`` show what each policy keeps for backward. Then every policy is checked against
no remat: the same loss and the same gradients, bit for bit (the recompute runs the same
fp32 ops). The model runs with transformers' default ``use_cache=True``: torch_remat runs
the layers it recomputes without the key/value cache, as HF's own checkpointing does (and
says so once). Needs only ``titan-remat``, torch and transformers.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torch_remat as tr


def make_model() -> LlamaForCausalLM:
    """A 2-layer Llama of width 64, the same weights every call (seeded)."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


def make_batch() -> dict[str, torch.Tensor]:
    """Random token ids and their own labels (causal LM loss)."""
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def train(steps: int) -> dict[str, object]:
    """The loop as a user writes it: measure, plan, apply a policy, train. Returns the numbers."""
    model, batch = make_model(), make_batch()
    step = {"kwargs": batch, "loss_fn": lambda out: out.loss, "steps": 1, "warmup": 0}
    no_remat = tr.measure(model, **step).saved_bytes  # loss_fn gets what model(**batch) returns
    tr.apply(model, tr.Selective(save=("matmul",), matmul_every=2))  # units: model.model.layers.*
    every_other = tr.measure(model, **step).saved_bytes
    tr.remove(model)
    plan = tr.plan(model, (), 0.5, sample_kwargs=batch)  # fit half the no-remat bytes
    tr.apply(model, plan.policies)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {
        "saved_bytes": {"none": no_remat, "every other matmul": every_other},
        "planned_bytes": plan.planned_bytes,
        "budget_bytes": plan.budget_bytes,
        "planned_measured": tr.measure(model, **step).saved_bytes,
        "losses": losses,
    }


def loss_and_grads(model: LlamaForCausalLM, batch: dict) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def compare() -> dict[str, dict[str, float]]:
    """Per policy: saved bytes (``measure``), and the loss and gradient differences from
    the same model without remat."""
    model, batch = make_model(), make_batch()
    step = {"kwargs": batch, "loss_fn": lambda out: out.loss, "steps": 1, "warmup": 0}
    want_loss, want = loss_and_grads(model, batch)
    report = {"none": {"saved_bytes": tr.measure(model, **step).saved_bytes}}
    policies = {
        "Full": tr.Full(),
        "Selective(matmul, attention)": tr.Selective(),
        "Selective(every other matmul)": tr.Selective(save=("matmul",), matmul_every=2),
        "Budget(50%)": tr.Budget(0.5),
    }
    for name, policy in policies.items():
        tr.apply(model, policy, sample_kwargs=batch)
        loss, grads = loss_and_grads(model, batch)
        report[name] = {
            "saved_bytes": tr.measure(model, **step).saved_bytes,
            "loss_diff": abs(loss - want_loss),
            "max_grad_diff": max((grads[n] - g).abs().max().item() for n, g in want.items()),
        }
        tr.remove(model)
    return report


def main() -> None:
    trained = train(steps=4)
    print(f"trained with the plan: losses {[round(x, 4) for x in trained['losses']]}")
    report = compare()
    none = report["none"]["saved_bytes"]
    for name, r in report.items():
        diffs = ""
        if name != "none":
            diffs = f", loss diff {r['loss_diff']:.1e}, grad diff {r['max_grad_diff']:.1e}"
        print(
            f"{name:32s} saved {r['saved_bytes'] / 2**20:6.3f} MiB "
            f"({r['saved_bytes'] / none:.2f} of no remat){diffs}"
        )
    assert trained["losses"][-1] < trained["losses"][0], "the loss did not fall"
    assert trained["planned_measured"] == trained["planned_bytes"] <= trained["budget_bytes"]
    for name, r in report.items():
        if name != "none":
            assert r["loss_diff"] == 0 and r["max_grad_diff"] == 0, (name, r)
            assert r["saved_bytes"] < none, name


if __name__ == "__main__":
    main()
