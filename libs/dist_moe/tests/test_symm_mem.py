"""Symmetric-memory expert parallelism, its protocol driven through the CPU emulation.

``SymmMemDispatcher(emulate=True)`` runs the real protocol (layouts, offsets, signal flags,
capacity and overflow) on CPU tensors in shared-memory files between gloo ranks. Claims:

* outputs, input gradients and router/shared-expert gradients equal one process running
  the same MoE on each rank's tokens **bitwise** (fp32; the per-token combine sums the same
  rows in the same order), for dropless, capacity without drops, and capacity with drops;
* they equal ``AllToAllDispatcher`` bitwise where that dispatcher sums in the same order
  (top-2 dropless, where float addition of two partials commutes, and capacity mode);
  expert-weight gradients equal the all-to-all ones bitwise in every case (dropless: the
  owner regroups the received blocks into all-to-all's layout from the counts carried in
  the buffer; capacity: the same blocks), and the one-process sum over ranks within 1e-6
  (a different summation order);
* chunk ``c``'s expert GEMMs are issued before the wait for chunk ``c + 1``'s tokens;
* the whole layer, forward and backward, issues no host synchronisation and allocates the
  same shapes whatever the routing (the all-to-all dropless path is the control that the
  detector sees a sync);
* the Triton put kernel (one kernel per chunk into every peer's buffer, packing fused in),
  run under ``TRITON_INTERPRET=1`` against the same emulated heap, equals the torch copies;
* bad input (capacity below the worst case with ``overflow="error"``, a gloo group without
  ``emulate``, more tokens than ``max_tokens``) fails before any communication.

Bitwise comparisons need a GEMM whose rows do not depend on the other rows of the call;
CPU fp32 ``mm`` at these sizes (D=16, I=8) is, for 4 rows or more (1-3 rows take another
kernel), which every case's alignment (>= 4) guarantees; ``..._bitwise_precondition`` checks.
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from dist_moe import (
    MoE,
    MoEConfig,
    PermuteConfig,
    RouterConfig,
    SymmMemDispatcher,
    expert_parallel,
)
from titan_testing import cuda_device_count, requires_gpus, run_distributed

DIM, HIDDEN = 16, 8

CASES = {
    "dropless_uneven_tokens_top2_shared": dict(
        tokens=[5, 11, 0, 7],
        moe=dict(num_experts=8, top_k=2, shared=8),
        symm=dict(max_tokens=11),
        a2a_bitwise=True,
    ),
    "dropless_top3_one_flag_per_expert": dict(
        tokens=[9, 9, 9, 9],
        moe=dict(num_experts=8, top_k=3, permute=PermuteConfig(alignment=4)),
        symm=dict(chunks="per_expert"),
        a2a_bitwise=False,  # all-to-all adds per-rank partial sums: another order for K=3
    ),
    "capacity_without_overflow": dict(
        tokens=[12, 12, 12, 12],
        moe=dict(num_experts=8, top_k=2, permute=PermuteConfig(alignment=4, capacity_factor=4.0)),
        symm=dict(overflow="error"),
        a2a_bitwise=True,
    ),
    "capacity_overflow_drops": dict(
        tokens=[12, 12, 12, 12],
        bias={3: 1.0, 5: 1.0},
        moe=dict(num_experts=8, top_k=2, permute=PermuteConfig(alignment=4, capacity_factor=1.0)),
        symm=dict(overflow="drop", chunks=1),
        a2a_bitwise=True,
        expect_drops=True,
    ),
}


def _build(seed, num_experts, top_k, shared=0, permute=None):
    torch.manual_seed(seed)
    cfg = MoEConfig(
        dim=DIM,
        hidden_dim=HIDDEN,
        router=RouterConfig(num_experts=num_experts, top_k=top_k),
        shared_hidden_dim=shared,
        permute=permute or PermuteConfig(),
    )
    moe = MoE(cfg)
    moe.reset_parameters(std=0.3)
    moe.train()
    return moe


def _inputs(tokens, rank):
    x = torch.randn(tokens[rank], DIM, generator=torch.Generator().manual_seed(100 + rank))
    g = torch.randn(tokens[rank], DIM, generator=torch.Generator().manual_seed(200 + rank))
    return x, g


def _step(moe, x, g):
    """Forward + backward; returns (out, x.grad, {param: grad})."""
    moe.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    y = moe(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in moe.named_parameters()}


def _symm_dispatcher(moe, case, ep):
    opts = dict(case["symm"])
    if opts.get("chunks") == "per_expert":
        opts["chunks"] = moe.config.router.num_experts // ep
    return SymmMemDispatcher(
        moe.config.router.num_experts, None, moe.config.permute, emulate=True, **opts
    )


def _max_err(a, b):
    return (a - b).abs().max().item() if a.numel() else 0.0


def _run_case(seed, case):
    rank, ws = dist.get_rank(), dist.get_world_size()
    tokens = case["tokens"][:ws]
    full = _build(seed, **case["moe"])
    with torch.no_grad():
        for e, b in case.get("bias", {}).items():
            full.router.expert_bias[e] = b

    # one process: every rank's tokens in turn, all experts local
    ref = [_step(copy.deepcopy(full), *_inputs(tokens, r)) for r in range(ws)]
    x, g = _inputs(tokens, rank)
    a2a = copy.deepcopy(full)
    placement = expert_parallel(a2a, dispatcher="all_to_all")
    a2a_out, a2a_xg, a2a_grads = _step(a2a, x, g)
    symm = copy.deepcopy(full)
    expert_parallel(symm, dispatcher=_symm_dispatcher(symm, case, ws))
    out, xg, grads = _step(symm, x, g)
    out2, xg2, _ = _step(symm, x, g)  # the same buffers serve a second forward + backward

    r_out, r_xg, r_grads = ref[rank]
    res = {
        "out == one process": torch.equal(out, r_out),
        "x.grad == one process": torch.equal(xg, r_xg),
        "second step identical": torch.equal(out2, out) and torch.equal(xg2, xg),
        "dropped": int(symm.dispatcher.dropped),
    }
    for n, gr in grads.items():
        if n.startswith("experts."):
            want = placement.shard(sum(rg[n] for _, _, rg in ref))
            res[f"{n} err vs one process"] = _max_err(gr, want)
            res[f"{n} == all-to-all"] = torch.equal(gr, a2a_grads[n])
        else:
            res[f"{n} == one process"] = torch.equal(gr, r_grads[n])
    if case["a2a_bitwise"]:
        res["out == all-to-all"] = torch.equal(out, a2a_out)
        res["x.grad == all-to-all"] = torch.equal(xg, a2a_xg)
    else:
        res["out err vs all-to-all"] = _max_err(out, a2a_out)
    return res


def _chunk_order():
    """Log of one forward with 4 chunks: waits for chunk c+1 come after chunk c's GEMMs."""
    ws = dist.get_world_size()
    moe = _build(7, num_experts=4 * ws, top_k=2)
    expert_parallel(moe, dispatcher=SymmMemDispatcher(4 * ws, None, PermuteConfig(), emulate=True))
    x = torch.randn(6, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    moe(x)  # allocates the buffers
    [st] = moe.dispatcher._exchanges.values()
    log = []
    wait, experts_forward = st.heap.wait_signal, moe.experts.forward

    def logged_wait(peer, channel):
        log.append(("wait", channel))
        wait(peer, channel)

    def logged_experts(rows, group_ends, weights=None):
        log.append(("gemm", rows.shape[0]))
        return experts_forward(rows, group_ends, weights)

    st.heap.wait_signal = logged_wait
    moe.experts.forward = logged_experts
    with torch.no_grad():
        moe(x)
    return log


class _SyncAndShapeRecorder(TorchDispatchMode):
    """Counts host syncs and data-dependent-shape ops; records every op's output shapes."""

    DYNAMIC = ("nonzero", "unique", "masked_select", "bincount", "repeat_interleave")

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # nothing is compiled here; the default wraps the hook in torch._dynamo (~10 s import)
        return False

    def __init__(self):
        super().__init__()
        self.syncs, self.dynamic, self.shapes = [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "item"):
            self.syncs.append(name)
        if any(name.startswith(d) for d in self.DYNAMIC):
            self.dynamic.append(name)
        out = func(*args, **(kwargs or {}))
        flat = out if isinstance(out, (tuple, list)) else [out]
        self.shapes.append((name, tuple(tuple(t.shape) for t in flat if hasattr(t, "shape"))))
        return out


def _no_sync_run(moe, x, g):
    rec = _SyncAndShapeRecorder()
    tolist = torch.Tensor.tolist

    def counted_tolist(t):
        rec.syncs.append("tolist")
        return tolist(t)

    with mock.patch.object(torch.Tensor, "tolist", counted_tolist), rec:
        x = x.clone().requires_grad_()
        y = moe(x)
        (y * g).sum().backward()
    return rec


def _no_host_sync():
    """Each layout: syncs, dynamic ops, and whether skewed routing allocates the same shapes."""
    ws = dist.get_world_size()
    e = 4 * ws
    layouts = {
        "symm_mem dropless": (PermuteConfig(alignment=4), "symm"),
        "symm_mem capacity": (PermuteConfig(alignment=4, capacity_factor=1.0), "symm"),
        "all_to_all capacity": (PermuteConfig(alignment=4, capacity_factor=1.0), "all_to_all"),
        "local static_shapes": (PermuteConfig(alignment=4, static_shapes=True), "local"),
        "all_to_all dropless (control)": (PermuteConfig(alignment=4), "all_to_all"),
    }
    out = {}
    for name, (permute_cfg, kind) in layouts.items():
        moe = _build(3, num_experts=e, top_k=2, shared=8, permute=permute_cfg)
        if kind == "symm":
            expert_parallel(moe, dispatcher=SymmMemDispatcher(e, None, permute_cfg, emulate=True))
        elif kind == "all_to_all":
            expert_parallel(moe)
        x = torch.randn(10, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
        g = torch.randn(10, DIM)
        _no_sync_run(moe, x, g)  # warm-up: buffers are allocated once, outside the check
        balanced = _no_sync_run(moe, x, g)
        with torch.no_grad():
            moe.router.expert_bias.zero_()
            moe.router.expert_bias[1] = 50.0  # every token now picks expert 1
        skewed = _no_sync_run(moe, x, g)
        out[name] = dict(
            syncs=sorted(set(balanced.syncs + skewed.syncs)),
            dynamic=sorted(set(balanced.dynamic + skewed.dynamic)),
            same_shapes=balanced.shapes == skewed.shapes,
            num_ops=len(balanced.shapes),
        )
    return out


def _triton_puts():
    """Triton put kernels (under the interpreter) vs the torch copies: max |diff| per value."""
    e = 4 * dist.get_world_size()
    x, g = _inputs([10] * 4, dist.get_rank())
    res = {}
    for layout, factor in (("dropless", None), ("capacity with drops", 0.5)):
        steps = {}
        for kernels in ("torch", "triton"):
            cfg = PermuteConfig(alignment=4, capacity_factor=factor, kernels=kernels)
            moe = _build(5, num_experts=e, top_k=2, permute=cfg)
            expert_parallel(moe, dispatcher=SymmMemDispatcher(e, None, cfg, chunks=2, emulate=True))
            steps[kernels] = _step(moe, x, g)
        (o1, xg1, g1), (o2, xg2, g2) = steps["torch"], steps["triton"]
        res[f"{layout} out"] = _max_err(o1, o2)
        res[f"{layout} x.grad"] = _max_err(xg1, xg2)
        res[f"{layout} grads"] = max(_max_err(g1[n], g2[n]) for n in g1)
    return res


def _all_checks():
    results = {n: _run_case(i, c) for i, (n, c) in enumerate(CASES.items())}
    two = dist.get_world_size() == 2
    extra = (_bad_input(), _triton_puts()) if two else None
    return results, _chunk_order(), _no_host_sync(), extra


def _check(world_size):
    env = {"TRITON_INTERPRET": "1"} if world_size == 2 else None
    per_rank = run_distributed(_all_checks, world_size, timeout=400, env=env)
    drops = {n: 0 for n in CASES}
    for rank, (results, log, sync, extra) in enumerate(per_rank):
        if extra is not None:
            bad, triton_vs_torch = extra
            _check_bad_input(bad)
            assert len(triton_vs_torch) == 6
            for what, err in triton_vs_torch.items():  # row copies, fp32 sums in k order
                assert err <= 1e-6, f"rank {rank} Triton puts vs torch copies, {what}: {err}"
        for case, res in results.items():
            drops[case] += res.pop("dropped")
            for what, v in res.items():
                if isinstance(v, bool):
                    assert v, f"rank {rank} {case}: {what} is False"
                else:
                    assert v <= 1e-6, f"rank {rank} {case}: {what} = {v}"
        # chunk c's GEMM comes before any wait of chunk c + 1 (channels 0..3 = chunks)
        chunk_of = [entry[1] for entry in log if entry[0] == "wait" and entry[1] < 4]
        gemms = [i for i, entry in enumerate(log) if entry[0] == "gemm"]
        assert len(gemms) == 4 and chunk_of == sorted(chunk_of), log
        waits = [i for i, entry in enumerate(log) if entry[0] == "wait" and entry[1] < 4]
        per_chunk = len(waits) // 4
        for c in range(3):
            assert gemms[c] < waits[(c + 1) * per_chunk], log
        for name, s in sync.items():
            if "control" in name:
                assert "tolist" in s["syncs"], f"the detector missed {name}'s host sync: {s}"
                continue
            assert s["syncs"] == [] and s["dynamic"] == [], f"rank {rank} {name}: {s}"
            assert s["same_shapes"] and s["num_ops"] > 50, f"rank {rank} {name}: {s}"
    for case, c in CASES.items():
        if c.get("expect_drops"):
            assert drops[case] > 0, f"{case}: no assignment was dropped, the case tests nothing"
        else:
            assert drops[case] == 0, f"{case}: {drops[case]} assignments dropped"


def test_ep2_symm_mem_emulated_equals_one_process_all_to_all_and_triton_puts():
    _check(2)


def test_ep4_symm_mem_emulated_equals_one_process_and_all_to_all():
    _check(4)


def test_cpu_mm_rows_do_not_depend_on_other_rows_bitwise_precondition():
    torch.manual_seed(0)
    for w in (torch.randn(HIDDEN, DIM), torch.randn(DIM, HIDDEN)):
        x = torch.randn(80, w.shape[1])
        full = x @ w.T
        for m in (4, 8, 12, 16, 24, 36):
            for off in (0, 5, 17):
                assert torch.equal(x[off : off + m] @ w.T, full[off : off + m]), m


def _bad_input():
    errors = {}
    moe = _build(0, num_experts=8, top_k=2, permute=PermuteConfig(capacity_factor=1.0))
    d = SymmMemDispatcher(8, None, moe.config.permute, overflow="error", emulate=True)
    expert_parallel(moe, dispatcher=d)
    try:
        moe(torch.randn(16, DIM))
    except ValueError as e:
        errors["capacity"] = str(e)
    try:
        SymmMemDispatcher(8, None, PermuteConfig())  # a gloo group: no symmetric memory
    except ValueError as e:
        errors["gloo"] = str(e)
    d = SymmMemDispatcher(8, None, PermuteConfig(), max_tokens=4, emulate=True)
    try:
        d.capacity(5, 2)
    except ValueError as e:
        errors["max_tokens"] = str(e)
    for kwargs in (dict(chunks=5), dict(overflow="wrap")):
        try:
            SymmMemDispatcher(8, None, PermuteConfig(), emulate=True, **kwargs)
        except ValueError as e:
            errors[next(iter(kwargs))] = str(e)
    return errors


def _check_bad_input(errors):
    assert (
        "overflow='error'" in errors["capacity"]
        and "capacity_factor >= E/K = 4" in (errors["capacity"])
    )
    assert "NCCL" in errors["gloo"] and "'gloo'" in errors["gloo"]
    assert "emulate=True" in errors["gloo"]
    assert "max_tokens=4" in errors["max_tokens"]
    assert "chunks must be an int in [1, 4]" in errors["chunks"]
    assert "'drop' or 'error'" in errors["overflow"]


def _cuda_symm_mem_checks():
    results = {}
    for i, (name, case) in enumerate(CASES.items()):
        if "uneven" in name:
            continue
        results[name] = _run_case_cuda(i, case)
    return results


def _run_case_cuda(seed, case):
    """Same comparison on CUDA symmetric memory (bf16 would not be bitwise: fp32 here)."""
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    full = _build(seed, **case["moe"]).cuda()
    x, g = (t.cuda() for t in _inputs(case["tokens"], rank))
    ref = _step(copy.deepcopy(full), x, g)
    symm = copy.deepcopy(full)
    opts = {k: v for k, v in case["symm"].items() if k != "chunks"}
    expert_parallel(symm, dispatcher=SymmMemDispatcher(8, None, full.config.permute, **opts))
    out, xg, _ = _step(symm, x, g)
    return {"out": _max_err(out, ref[0]), "x.grad": _max_err(xg, ref[1])}


@pytest.mark.gpu
@requires_gpus(2)
def test_ep2_symm_mem_on_cuda_matches_one_process():
    per_rank = run_distributed(_cuda_symm_mem_checks, 2, backend="nccl", timeout=300)
    for rank, results in enumerate(per_rank):
        for case, errs in results.items():
            for what, err in errs.items():
                assert err <= 1e-5, f"rank {rank} {case} {what}: {err}"


def _graph_capture_checks():
    """The whole layer (router, pack, dispatch, experts, combine) in one CUDA graph, bf16."""
    torch.manual_seed(0)
    results = {}
    world = dist.get_world_size()
    layouts = {
        "local static_shapes": (PermuteConfig(static_shapes=True), None),
        "local capacity": (PermuteConfig(capacity_factor=1.0), None),
        "symm_mem dropless": (PermuteConfig(), "symm"),
        "symm_mem capacity": (PermuteConfig(capacity_factor=1.0), "symm"),
    }
    for name, (cfg, kind) in layouts.items():
        moe = MoE(
            MoEConfig(
                dim=256,
                hidden_dim=128,
                router=RouterConfig(num_experts=8, top_k=2),
                shared_hidden_dim=128,
                permute=cfg,
                experts_impl="grouped_mm",
            )
        )
        moe = moe.cuda().to(torch.bfloat16).eval()
        if kind == "symm":
            expert_parallel(moe, dispatcher=SymmMemDispatcher(8, None, cfg))
        static_x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.no_grad(), torch.cuda.stream(side):
            for _ in range(2):  # warm-up: buffers, Triton compilation, rendezvous
                moe(static_x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph):
            static_y = moe(static_x)
        same = []
        for seed in range(3):
            x = torch.randn(
                512,
                256,
                device="cuda",
                dtype=torch.bfloat16,
                generator=torch.Generator("cuda").manual_seed(seed + 10 * world),
            )
            static_x.copy_(x)
            graph.replay()
            with torch.no_grad():
                eager = moe(x)
            same.append(torch.equal(static_y, eager))
        results[name] = same
    return results


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [1, 2])
def test_moe_layer_captured_in_a_cuda_graph_replays_like_eager(world_size):
    if cuda_device_count() < world_size:
        pytest.skip(f"needs {world_size} CUDA device(s), found {cuda_device_count()}")
    per_rank = run_distributed(_graph_capture_checks, world_size, backend="nccl", timeout=300)
    for rank, results in enumerate(per_rank):
        for name, same in results.items():
            assert all(same), f"rank {rank} {name}: graph replays differ from eager: {same}"
