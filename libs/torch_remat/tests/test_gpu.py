"""Accelerator paths (run on CUDA): pinned-memory offload really empties the device; peak from
the allocator; the device RNG restored after planning."""

from __future__ import annotations

import torch

import torch_remat as tr
from titan_testing import requires_gpus


@requires_gpus(1)
def test_offload_on_cuda_keeps_no_activation_on_the_device(make_stack):
    model, tokens = make_stack(layers=4, dim=256, seq=256)
    model, tokens = model.cuda(), tokens.cuda()
    plain = tr.measure(model, (tokens,), steps=1, warmup=1)
    everything = ["embed", "layers.*", "norm", "head"]
    tr.apply(model, tr.Offload(), everything)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    out = model(tokens)
    held = torch.cuda.memory_allocated() - before - out.untyped_storage().nbytes()
    out.square().mean().backward()
    off = tr.measure(model, (tokens,), steps=1, warmup=0)
    print(f"plain {plain}\noffload {off}\ndevice bytes held after forward: {held}")
    assert off.saved_bytes == 0
    assert off.offloaded_bytes >= plain.saved_bytes
    # What stays on the device between forward and backward is the output, not activations.
    assert held < 0.05 * plain.saved_bytes


@requires_gpus(1)
def test_selective_on_cuda_matches_plain_gradients(make_stack):
    def grads(policy, *, in_region=False):
        model, tokens = make_stack(layers=2, dim=128, seq=64)
        model, tokens = model.cuda(), tokens.cuda()
        if policy is not None and in_region:
            for block in model.layers:
                block.mlp_region = policy  # replays its dropout from the device RNG it recorded
        elif policy is not None:
            tr.apply(model, policy)
        torch.manual_seed(5)
        model(tokens).square().mean().backward()
        return [p.grad for p in model.parameters()]

    want = grads(None)
    for policy in (tr.Full(), tr.Selective(matmul_every=2), tr.Offload()):
        for in_region in (False, True):
            for g, w in zip(grads(policy, in_region=in_region), want, strict=True):
                assert torch.equal(g, w), (policy, in_region)


@requires_gpus(1)
def test_measure_and_plan_on_the_accelerator_use_its_allocator_and_rng(make_stack):
    model, tokens = make_stack(layers=2, dim=128, seq=64)  # with dropout: forwards draw numbers
    model, tokens = model.cuda(), tokens.cuda()
    m = tr.measure(model, (tokens,), steps=1, warmup=0)
    assert m.peak_bytes >= m.saved_bytes > 0  # torch.accelerator's counters, not the CPU path
    state = torch.cuda.get_rng_state()
    tr.plan(model, (tokens,), 0.5)  # profiling forwards run under a fork of the device RNG
    assert torch.equal(torch.cuda.get_rng_state(), state)
