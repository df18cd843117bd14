"""Shared helpers of flexshard's tests: bucket recipes, the training loop, references.

Loaded by the test modules through ``_load_cases()`` (pytest runs with importlib mode, so
this folder is not on ``sys.path``); the functions run both in the pytest process (the
single-process references) and on the ranks.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flexshard as fs
from flexshard.testing import TinyTransformer, lm_batch

VOCAB, DIM, LAYERS, HIDDEN = 37, 16, 2, 42
BATCH, SEQ, STEPS, LR = 8, 6, 5, 1e-3


def make_model(seed: int = 0, layers: int = LAYERS) -> TinyTransformer:
    torch.manual_seed(seed)
    return TinyTransformer(vocab=VOCAB, dim=DIM, n_layers=layers, n_heads=2, hidden=HIDDEN)


def _is_attn(f: str) -> bool:
    return any(f.endswith(f".{n}.weight") for n in ("wq", "wk", "wv", "wo"))


def buckets(kind: str, model: torch.nn.Module) -> list[fs.Bucket] | None:
    """Bucket recipes by name; every one covers every parameter exactly once."""
    L = len(model.layers)
    if kind == "shard0":
        return None  # the default: Shard(0) per block + root
    if kind == "replicate":
        return fs.default_buckets(model, fs.Replicate())
    if kind == "owned":
        return fs.default_buckets(model, fs.Owned())
    if kind == "owned_flops":
        return fs.default_buckets(model, fs.Owned(balance="flops"))
    if kind == "shard1":  # column-wise for matrices, row-wise for vectors, per block
        out = []
        for i in range(L):
            pre = f"layers.{i}."
            out.append(
                fs.Bucket(lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 2, fs.Shard(1))
            )
            out.append(
                fs.Bucket(lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 1, fs.Shard(0))
            )
        out.append(fs.Bucket(["tok_emb.weight", "head.weight"], fs.Shard(1)))
        out.append(fs.Bucket("norm.weight", fs.Shard(0)))
        return out
    if kind == "blockshard":
        out = []
        for i in range(L):
            pre = f"layers.{i}."
            out.append(
                fs.Bucket(
                    lambda f, p, pre=pre: f.startswith(pre) and _is_attn(f), fs.BlockShard((8, 8))
                )
            )
            out.append(
                fs.Bucket(lambda f, p, pre=pre: f.startswith(pre) and not _is_attn(f), fs.Shard(0))
            )
        out.append(fs.Bucket(["tok_emb.weight", "head.weight", "norm.weight"], fs.Shard(0)))
        return out
    if kind == "muon_owned":  # block matrices whole on one rank each, vectors replicated
        out = []
        for i in range(L):
            pre = f"layers.{i}."
            out.append(
                fs.Bucket(
                    lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 2,
                    fs.Owned(balance="flops"),
                )
            )
            out.append(
                fs.Bucket(lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 1, fs.Replicate())
            )
        out.append(fs.Bucket(["tok_emb.weight", "head.weight", "norm.weight"], fs.Shard(0)))
        return out
    if kind == "mixed":  # every placement in one model
        return [
            fs.Bucket(lambda f, p: f.startswith("layers.0.") and p.dim() == 2, fs.Owned()),
            fs.Bucket(lambda f, p: f.startswith("layers.0.") and p.dim() == 1, fs.Replicate()),
            fs.Bucket(
                lambda f, p: f.startswith("layers.1.") and _is_attn(f), fs.BlockShard((8, 8))
            ),
            fs.Bucket(["layers.1.w1.weight", "layers.1.w2.weight"], fs.Shard(1)),
            fs.Bucket(lambda f, p: f.startswith("layers.1.") and p.dim() == 1, fs.Shard(0)),
            fs.Bucket("tok_emb.weight", fs.Shard(0)),
            fs.Bucket("head.weight", fs.Shard(1)),
            fs.Bucket("norm.weight", fs.Replicate()),
        ]
    raise KeyError(kind)


MUON_LR, ADAMW_LR, ADAMW_WD = 0.02, 1e-3, 0.01


def is_muon_param(fqn: str, p) -> bool:
    """Block matrices get Muon; embeddings, head, norms and biases get AdamW."""
    info = fs.param_info(p)
    shape = info.shape if info is not None else p.shape
    return fqn.startswith("layers.") and len(shape) == 2


def make_optimizer(case: dict[str, Any], model: torch.nn.Module, sharded: bool):
    if case.get("optim") != "muon":
        return [torch.optim.AdamW(model.parameters(), lr=LR)]
    mats = [p for n, p in model.named_parameters() if is_muon_param(n, p)]
    rest = [p for n, p in model.named_parameters() if not is_muon_param(n, p)]
    if sharded:
        from flexshard.optim import Muon

        return [
            Muon(
                [
                    {"params": mats, "use_muon": True},
                    {"params": rest, "use_muon": False, "lr": ADAMW_LR, "weight_decay": ADAMW_WD},
                ],
                lr=MUON_LR,
                ns_dtype=torch.float32 if case.get("ns") == "fp32" else torch.bfloat16,
            )
        ]
    return [
        torch.optim.Muon(mats, lr=MUON_LR),
        torch.optim.AdamW(rest, lr=ADAMW_LR, weight_decay=ADAMW_WD, foreach=False),
    ]


def remat_blocks(model) -> None:
    """Activation checkpointing inside every block (recomputed in backward by calling the
    block's forward directly, without module hooks)."""
    import functools

    from torch.utils.checkpoint import checkpoint

    for layer in model.layers:
        layer.forward = functools.partial(
            checkpoint, type(layer).forward.__get__(layer), use_reentrant=False
        )


def loss_fn(model, x, y) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())


def _data(step: int, micro: int, accum: int):
    """The global batch of one micro-step: ``BATCH`` sequences."""
    return lm_batch(VOCAB, BATCH, SEQ, seed=1000 * step + micro)


# ---------------------------------------------------------------------------------------
# One distributed case (runs on every rank)
# ---------------------------------------------------------------------------------------


def chunks_of(model) -> dict[str, Any]:
    """This rank's pieces of every parameter, from the sharded state dict."""
    out = {}
    for k, v in fs.sharded_state_dict(model).items():
        if isinstance(v, fs.ShardedParam):
            out[k] = (
                "sharded",
                tuple(v.global_shape),
                [(o, t.detach().cpu().clone()) for o, t in v.local_chunks()],
            )
        else:
            out[k] = ("replicated", tuple(v.shape), v.detach().cpu().clone())
    return out


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device(case.get("device", "cpu"))
    if dev.type == "cuda":
        dev = torch.device("cuda", torch.cuda.current_device())
    model = make_model(layers=case.get("layers", LAYERS)).to(dev)
    if case.get("remat"):
        remat_blocks(model)
    mp = None
    if case.get("mp") == "bf16":
        mp = fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    elif case.get("reduce") == "fp64":
        mp = fs.MixedPrecision(reduce_dtype=torch.float64)
    fs.shard(
        model,
        buckets=buckets(case["buckets"], model),
        mp=mp,
        reshard_after_forward=case.get("reshard", True),
        prefetch=case.get("prefetch", 1),
        reduce_order=case.get("reduce_order", "backend"),
    )
    opts = make_optimizer(case, model, sharded=True)
    accum = case.get("accum", 1)
    b = BATCH // world
    norms, losses, micro_comm = [], [], []
    for step in range(STEPS):
        for micro in range(accum):
            x, y = _data(step, micro, accum)
            x, y = x[rank * b : (rank + 1) * b].to(dev), y[rank * b : (rank + 1) * b].to(dev)
            last = micro == accum - 1
            c0 = dict(fs.comm_stats(model).calls)
            model.set_requires_gradient_sync(last)
            loss = loss_fn(model, x, y) / accum
            c1 = dict(fs.comm_stats(model).calls)
            loss.backward()
            c2 = dict(fs.comm_stats(model).calls)
            fwd = {k: c1.get(k, 0) - c0.get(k, 0) for k in c1 if c1.get(k, 0) - c0.get(k, 0)}
            bwd = {k: c2.get(k, 0) - c1.get(k, 0) for k in c2 if c2.get(k, 0) - c1.get(k, 0)}
            micro_comm.append((micro, fwd, bwd))
            losses.append(loss.item())
        if case.get("clip"):
            norms.append(fs.clip_grad_norm_(model, case["clip"]).item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {
        "chunks": chunks_of(model),
        "norms": norms,
        "micro_comm": micro_comm,
        "comm": fs.comm_stats(model).as_dict(),
        "optim_comm": opts[0].comm.as_dict() if hasattr(opts[0], "comm") else None,
        "mem_peak": fs.memory_stats(model).peak,
        "mem_current": fs.memory_stats(model).current,
    }


def run_cases(cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {name: run_case(c) for name, c in cases.items()}


# ---------------------------------------------------------------------------------------
# Single-process references (pytest process)
# ---------------------------------------------------------------------------------------


def reference(
    case: dict[str, Any], world: int, per_rank: bool = True
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The same training on one process.

    ``per_rank=True``: a copy of the model (in bf16 for ``mp="bf16"``) computes each rank's
    gradient on that rank's slice, and their fp32 average feeds AdamW on the fp32 weights:
    the arithmetic of the ranks, except the order of the cross-rank sum (which does not
    matter for ``reduce="fp64"``: a sum of a few fp32 values is exact in fp64).
    ``per_rank=False`` (fp32 only): one backward over the whole global batch."""
    model = make_model(layers=case.get("layers", LAYERS))
    opts = make_optimizer(case, model, sharded=False)
    accum = case.get("accum", 1)
    low_dtype = torch.bfloat16 if case.get("mp") == "bf16" else torch.float32
    norms = []
    for step in range(STEPS):
        if not per_rank:
            xs, ys = zip(*(_data(step, m, accum) for m in range(accum)), strict=True)
            loss_fn(model, torch.cat(xs), torch.cat(ys)).backward()
        else:
            low = make_model(layers=case.get("layers", LAYERS)).to(low_dtype)
            low.load_state_dict(model.state_dict())
            grads = [[torch.zeros_like(p) for p in model.parameters()] for _ in range(world)]
            b = BATCH // world
            for r in range(world):
                for m in range(accum):
                    x, y = _data(step, m, accum)
                    low.zero_grad()
                    (
                        loss_fn(low, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]) / accum
                    ).backward()
                    for acc, p in zip(grads[r], low.parameters(), strict=True):
                        acc += p.grad.float()
            wide = torch.float64 if case.get("reduce") == "fp64" else torch.float32
            for i, p in enumerate(model.parameters()):
                total = sum(grads[r][i].to(wide) for r in range(world)) / world
                p.grad = total.to(p.dtype)
        if case.get("clip"):
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), case["clip"]).item())
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def assemble(per_rank: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's chunks; checks each element is held exactly once."""
    out = {}
    for key, (kind, shape, _) in per_rank[0].items():
        if kind == "replicated":
            vals = [r[key][2] for r in per_rank]
            for v in vals[1:]:
                assert torch.equal(v, vals[0]), f"{key}: replicas differ across ranks"
            out[key] = vals[0]
            continue
        full = torch.zeros(shape, dtype=torch.float32)
        seen = torch.zeros(shape, dtype=torch.int32)
        for r in per_rank:
            for off, t in r[key][2]:
                idx = tuple(slice(o, o + n) for o, n in zip(off, t.shape, strict=True))
                full[idx] = t.float()
                seen[idx] += 1
        assert bool((seen == 1).all()), f"{key}: chunks do not cover the tensor exactly once"
        out[key] = full
    return out


def max_err(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    assert set(a) == set(b), (sorted(a), sorted(b))
    worst = max(((a[k].float() - b[k].float()).abs().max().item(), k) for k in a)
    return worst


# ---------------------------------------------------------------------------------------
# Feature checks run on every rank (state dicts, bad input, memory, FP8)
# ---------------------------------------------------------------------------------------


def _expect_value_error(fn, *needles: str) -> str:
    try:
        fn()
    except ValueError as e:
        msg = str(e)
        missing = [n for n in needles if n not in msg]
        assert not missing, f"error {msg!r} does not name {missing}"
        return msg
    raise AssertionError(f"no ValueError (expected one naming {needles})")


def check_bad_input() -> list[str]:
    """Only rank 0 calls ``shard`` with bad input; rank 1 never communicates, so any
    collective before the check would hang rank 0 (and time the test out)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    rank = dist.get_rank()
    msgs = []
    # A mesh without this rank: built collectively, rejected on the ranks outside it.
    group0 = dist.new_group([0])
    mesh0 = DeviceMesh("cpu", [0])
    if rank != 0:
        msgs.append(
            _expect_value_error(lambda: fs.shard(make_model(), group0), "does not contain", "rank")
        )
        msgs.append(
            _expect_value_error(lambda: fs.shard(make_model(), mesh0), "does not contain", "rank")
        )
    dist.barrier()
    if rank != 0:
        return msgs
    m = make_model

    def shard_with(*bks, **kw):
        model = m()
        return lambda: fs.shard(
            model,
            buckets=[b(model) if callable(b) and not isinstance(b, fs.Bucket) else b for b in bks],
            **kw,
        )

    rest = fs.Bucket(lambda f, p: not f.startswith("layers.0."))
    msgs.append(
        _expect_value_error(
            shard_with(fs.Bucket("layers.0.**", fs.Shard(2)), rest),
            "layers.0.",
            "Shard(dim=2)",
            "dim must be in",
        )
    )
    msgs.append(
        _expect_value_error(
            shard_with(fs.Bucket("layers.0.**", fs.Shard(1)), rest),
            "layers.0.attn_norm.weight",
            "Shard(dim=1)",
        )
    )
    msgs.append(
        _expect_value_error(
            shard_with(
                fs.Bucket("layers.0.wq.weight", fs.BlockShard((5, 8))),
                fs.Bucket(lambda f, p: f != "layers.0.wq.weight"),
            ),
            "layers.0.wq.weight",
            "(5, 8)",
            "does not tile",
        )
    )
    msgs.append(
        _expect_value_error(
            shard_with(
                fs.Bucket("norm.weight", fs.BlockShard((4, 4))),
                fs.Bucket(lambda f, p: f != "norm.weight"),
            ),
            "norm.weight",
            "2-D",
        )
    )
    msgs.append(
        _expect_value_error(
            shard_with(
                fs.Bucket("layers.**", name="blocks"),
                fs.Bucket("layers.1.w1.*", name="w1"),
                fs.Bucket(lambda f, p: not f.startswith("layers.")),
            ),
            "layers.1.w1.weight",
            "'blocks'",
            "'w1'",
            "exactly one bucket",
        )
    )
    msgs.append(
        _expect_value_error(
            shard_with(fs.Bucket("layers.**")), "tok_emb.weight", "matched by no bucket"
        )
    )
    msgs.append(
        _expect_value_error(
            shard_with(fs.Bucket("**"), fs.Bucket("nothing.*", name="empty")),
            "'empty'",
            "matches no parameter",
        )
    )
    msgs.append(
        _expect_value_error(
            shard_with(fs.Bucket("**", fs.Owned(owner=5))),
            "Owned(owner=5)",
            f"{dist.get_world_size()} ranks",
        )
    )
    msgs.append(_expect_value_error(shard_with(fs.Bucket("**"), prefetch=-1), "prefetch"))
    msgs.append(
        _expect_value_error(
            lambda: fs.Bucket("**", fs.Shard(0), quantize="fp8_block"), "BlockShard"
        )
    )
    msgs.append(
        _expect_value_error(lambda: fs.Bucket("**", fs.Shard(0), quantize="int4"), "quantize")
    )
    msgs.append(_expect_value_error(lambda: fs.BlockShard((0, 4)), "block"))
    msgs.append(_expect_value_error(lambda: fs.Owned(balance="speed"), "balance"))
    msgs.append(
        _expect_value_error(
            lambda: fs.shard(
                torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]),
                buckets=[fs.Bucket("**")],
            ),
            "ModuleList",
            "no module with a forward",
        )
    )
    twice = m()
    fs.shard(twice, dist.new_group([0]))  # a 1-rank group: no peer needed
    msgs.append(_expect_value_error(lambda: fs.shard(twice), "already sharded"))
    return msgs


def check_state_dicts() -> dict[str, Any]:
    import torch.distributed as dist

    rank = dist.get_rank()
    out: dict[str, Any] = {}

    def trained(kind: str, seed: int):
        model = make_model(seed)
        fs.shard(model, buckets=buckets(kind, model))
        return model

    a = trained("mixed", 0)
    opt = torch.optim.AdamW(a.parameters(), lr=1e-2)
    x, y = _data(0, 0, 1)
    loss_fn(a, x, y).backward()
    opt.step()
    opt.zero_grad()
    sd_a = fs.sharded_state_dict(a)
    out["keys"] = list(sd_a)
    out["protocol"] = all(
        hasattr(v, "global_shape") and hasattr(v, "dtype") and callable(v.local_chunks)
        for v in sd_a.values()
        if isinstance(v, fs.ShardedParam)
    )
    out["chunks_a"] = chunks_of(a)
    full = fs.full_state_dict(a, rank0_only=False)
    out["full"] = full
    out["full_rank0_only_len"] = len(fs.full_state_dict(a))  # default rank0_only=True
    # full -> sharded (same layout): exact
    b = trained("mixed", 1)
    fs.load_full_state_dict(b, full)
    out["b_equal"] = _same_chunks(chunks_of(b), out["chunks_a"])
    # full (rank 0 only) -> another layout -> full: exact
    c = trained("owned", 2)
    fs.load_full_state_dict(c, full if rank == 0 else None, rank0_only=True)
    full_c = fs.full_state_dict(c, rank0_only=False)
    out["c_equal"] = all(torch.equal(full_c[k], full[k]) for k in full)
    # sharded -> sharded (same layout), as a checkpoint loader would hand it back
    d = trained("mixed", 3)
    fs.load_sharded_state_dict(d, sd_a)
    out["d_equal"] = _same_chunks(chunks_of(d), out["chunks_a"])
    # in-place fill of the protocol objects (what torch_checkpointing does on load)
    e = trained("mixed", 4)
    for k, v in fs.sharded_state_dict(e).items():
        src = sd_a[k]
        if isinstance(v, fs.ShardedParam):
            for (o, t), (o2, t2) in zip(v.local_chunks(), src.local_chunks(), strict=True):
                assert o == o2
                t.copy_(t2)
        else:
            v.copy_(src)
    out["e_equal"] = _same_chunks(chunks_of(e), out["chunks_a"])
    # the filled model trains on exactly like the original
    for model in (a, e):
        o2 = torch.optim.SGD(model.parameters(), lr=0.1)
        loss_fn(model, x, y).backward()
        o2.step()
    out["train_on_equal"] = _same_chunks(chunks_of(e), chunks_of(a))
    try:
        fs.load_full_state_dict(b, {k: v for k, v in full.items() if k != "norm.weight"})
        out["missing_key_error"] = None
    except ValueError as err:
        out["missing_key_error"] = str(err)
    return out


def _same_chunks(x: dict[str, Any], y: dict[str, Any]) -> bool:
    if set(x) != set(y):
        return False
    for k in x:
        kx, sx, vx = x[k]
        ky, sy, vy = y[k]
        if kx != ky or sx != sy:
            return False
        if kx == "replicated":
            if not torch.equal(vx, vy):
                return False
        elif len(vx) != len(vy) or any(
            ox != oy or not torch.equal(tx, ty) for (ox, tx), (oy, ty) in zip(vx, vy, strict=True)
        ):
            return False
    return True


def check_memory(layers: int = 24) -> dict[str, Any]:
    """Measured parameter bytes per rank with Shard(0) per block (reshard after forward)."""
    import torch.distributed as dist

    world = dist.get_world_size()
    model = make_model(layers=layers)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    block = sum(p.numel() * p.element_size() for p in model.layers[0].parameters())
    root = total - layers * block
    fs.shard(model, prefetch=1)
    stats = fs.memory_stats(model)
    resident0 = stats.current
    local = sum(p.numel() * p.element_size() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    b = BATCH // world
    rank = dist.get_rank()
    for step in range(2):
        x, y = _data(step, 0, 1)
        loss_fn(model, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]).backward()
        opt.step()
        opt.zero_grad()
    return {
        "total": total,
        "block": block,
        "root": root,
        "resident": resident0,
        "local_param_bytes": local,
        "after": stats.current,
        "peak": stats.peak,
    }


def fp8_model(seed: int = 0):
    torch.manual_seed(seed)
    return TinyTransformer(vocab=64, dim=32, n_layers=2, n_heads=2, hidden=64)


def fp8_buckets(model, quantize):
    out = []
    for i in range(len(model.layers)):
        pre = f"layers.{i}."
        out.append(
            fs.Bucket(
                lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 2,
                fs.BlockShard((8, 8)),
                quantize=quantize,
            )
        )
        out.append(
            fs.Bucket(lambda f, p, pre=pre: f.startswith(pre) and p.dim() == 1, fs.Replicate())
        )
    out.append(
        fs.Bucket(["tok_emb.weight", "head.weight"], fs.BlockShard((8, 8)), quantize=quantize)
    )
    out.append(fs.Bucket("norm.weight", fs.Replicate()))
    return out


def _tiles8(t: torch.Tensor) -> torch.Tensor:
    return t.view(t.shape[0] // 8, 8, t.shape[1] // 8, 8).permute(0, 2, 1, 3).reshape(-1, 8, 8)


def check_fp8() -> dict[str, Any]:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    x, y = lm_batch(64, 8, 12, seed=7)
    b = 8 // world
    x, y = x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]
    # Bytes of one forward: fp8 tiles + per-tile scales vs bf16 tiles.
    for q, dtype in (("fp8_block", torch.bfloat16), (None, torch.bfloat16)):
        model = fp8_model()
        fs.shard(model, buckets=fp8_buckets(model, q), mp=fs.MixedPrecision(param_dtype=dtype))
        with torch.no_grad():
            model(x)
        out[f"bytes_{q}"] = fs.comm_stats(model).bytes["all_gather"]
    # Dequantisation error of every gathered tile against its bound (fp32 compute dtype).
    for q in ("fp8_block", "fp8_block_pow2"):
        model = fp8_model()
        fs.shard(model, buckets=fp8_buckets(model, q))
        ref = fp8_model()
        locals_ = dict(model.named_parameters())
        model.unshard()
        assert all(
            dict(model.named_parameters())[n] is fs.param_info(p).full for n, p in locals_.items()
        )
        worst = 0.0
        for n, p in ref.named_parameters():
            info = fs.param_info(locals_[n])
            if not isinstance(info.placement, fs.BlockShard):
                continue
            got, want = info.full.detach(), p.detach()
            err = (_tiles8(got) - _tiles8(want)).abs()
            bound = fs.fp8_block_error_bound(_tiles8(want), pow2=q == "fp8_block_pow2")
            worst = max(worst, (err / bound).max().item())
            assert err.max() > 0  # it really was quantised
            if q == "fp8_block_pow2":  # q * 2^k: every gathered value is e4m3 times 2^k
                scale = fs.quantize_tiles(_tiles8(want), pow2=True)[1][:, None, None]
                v = _tiles8(got) / scale
                assert torch.equal(v.to(torch.float8_e4m3fn).float(), v)
        model.reshard()
        out[f"worst_err_over_bound_{q}"] = worst
    # The debug model still learns with fp8 gathers (bf16 compute, fp32 reduce).
    model = fp8_model()
    fs.shard(
        model,
        buckets=fp8_buckets(model, "fp8_block"),
        mp=fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(25):
        loss = loss_fn(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(t.item() / world)
    out["losses"] = losses
    return out


def check_owned_balance() -> dict[str, Any]:
    """Owner loads per rank (bytes and Newton–Schulz flops) and the largest single cost."""
    import torch.distributed as dist

    from flexshard.api import _ns_flops

    out = {}
    for balance in ("bytes", "flops"):
        model = make_model(layers=4)
        fs.shard(model, buckets=fs.default_buckets(model, fs.Owned(balance=balance)))
        loads = [0.0] * dist.get_world_size()
        costs = []
        for p in model.parameters():
            info = fs.param_info(p)
            c = info.numel * 4 if balance == "bytes" else _ns_flops(info.shape)
            loads[info.owner] += c
            costs.append(c)
            assert (p.numel() > 0) == (info.owner == dist.get_rank())
        out[balance] = (loads, max(costs))
    return out


def readme_example() -> float:
    """Owned matrices, distributed Muon, bf16 compute with fp32 reduction: one step as a user
    writes it."""
    import torch.nn.functional as F

    model = TinyTransformer(vocab=1000, dim=64, n_layers=4)
    mats = {f for f, p in model.named_parameters() if f.startswith("layers.") and p.dim() == 2}
    fs.shard(
        model,
        buckets=[
            fs.Bucket(list(mats), fs.Owned(balance="flops")),
            fs.Bucket(lambda f, p: f not in mats, fs.Shard(0)),
        ],
        mp=fs.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    )
    named = list(model.named_parameters())
    opt = fs.optim.Muon(
        [
            {"params": [p for f, p in named if f in mats]},
            {"params": [p for f, p in named if f not in mats], "use_muon": False, "lr": 3e-4},
        ],
        lr=0.02,
    )
    x, y = lm_batch(1000, 8, 32, seed=torch.distributed.get_rank())
    loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    fs.clip_grad_norm_(model, 1.0)
    opt.step()
    opt.zero_grad()
    return loss.item()


def check_overlap() -> dict[str, Any]:
    """Communication in flight while compute runs: during block 0's forward, block 1's
    gather has been issued (prefetch); during block 0's backward, the reductions of the
    blocks after it are still in flight."""
    import torch.distributed as dist

    from flexshard._runtime import _FREE

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(layers=3)
    fs.shard(model, prefetch=1)
    st = model.flexshard_state
    names = [b.name for b in st.buckets]
    nxt = st.buckets[names.index("layers.1")]
    seen: dict[str, list] = {"fwd": [], "bwd": []}
    model.layers[0].w1.register_forward_pre_hook(
        lambda m, a: seen["fwd"].append(nxt.status != _FREE)
    )
    model.layers[0].w1.register_full_backward_pre_hook(
        lambda m, g: seen["bwd"].append(len(st.pending_reduces))
    )
    b = BATCH // world
    for step in range(2):
        x, y = _data(step, 0, 1)
        loss_fn(model, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]).backward()
    return seen


def check_ignored_params() -> dict[str, Any]:
    """Ignored parameters (each rank's own values, as experts under expert parallelism) stay
    whole and untouched; their gradient is this rank's own, never reduced."""
    rank = dist.get_rank()
    model = make_model()
    ref = make_model()
    ignored = [model.layers[1].w1.weight, model.layers[1].w1.bias]
    with torch.no_grad():
        for p, q in zip(ignored, (ref.layers[1].w1.weight, ref.layers[1].w1.bias), strict=True):
            p.add_(0.01 * (rank + 1))
            q.copy_(p)
    fs.shard(
        model, buckets=fs.default_buckets(model, ignored_params=ignored), ignored_params=ignored
    )
    x, y = lm_batch(VOCAB, 2, SEQ, seed=rank)
    loss_fn(model, x, y).backward()
    loss_fn(ref, x, y).backward()
    params = list(model.parameters())
    return {
        "same_objects": all(any(p is q for q in params) for p in ignored),
        "whole": [tuple(p.shape) for p in ignored],
        "grad_err": max(
            float((p.grad - q.grad).abs().max())
            for p, q in zip(ignored, (ref.layers[1].w1.weight, ref.layers[1].w1.bias), strict=True)
        ),
        "others_sharded": tuple(model.layers[1].w2.weight.shape)
        != tuple(ref.layers[1].w2.weight.shape),
    }


def check_nested_full_state_dict() -> dict[str, Any]:
    """A submodule sharded on its own first (experts over their own mesh), then the rest with
    its parameters ignored: the full state dict of the whole holds every entry, whole."""
    model, ref = make_model(), make_model()
    inner = model.layers[1]
    fs.shard(inner)
    mine = list(inner.parameters())
    fs.shard(model, buckets=fs.default_buckets(model, ignored_params=mine), ignored_params=mine)
    full = fs.full_state_dict(model, rank0_only=False)
    want = ref.state_dict()
    return {
        "keys": sorted(full) == sorted(want),
        "err": max(float((full[k] - v).abs().max()) for k, v in want.items()),
    }


def check_optim_state() -> dict[str, Any]:
    """AdamW state as ShardedParams (every placement, rank-ordered reduction): each chunk
    equals the slice of one process's state; filled from one process's full state (what a
    resharding loader does) and stepped again, the model equals one process's, bit for bit."""
    rank, world = dist.get_rank(), dist.get_world_size()
    b = BATCH // world

    def shard_and_adamw(model):
        fs.shard(model, buckets=buckets("mixed", model), reduce_order="rank")
        return torch.optim.AdamW(model.parameters(), lr=LR)

    def sharded_step(model, opt, step):
        x, y = _data(step, 0, 1)
        loss_fn(model, x[rank * b : (rank + 1) * b], y[rank * b : (rank + 1) * b]).backward()
        opt.step()
        opt.zero_grad()

    ref = make_model()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR)

    def reference_step(step):
        x, y = _data(step, 0, 1)
        grads = []
        for r in range(world):
            ref.zero_grad()
            loss_fn(ref, x[r * b : (r + 1) * b], y[r * b : (r + 1) * b]).backward()
            grads.append([p.grad.clone() for p in ref.parameters()])
        for i, p in enumerate(ref.parameters()):
            p.grad = sum(g[i] for g in grads) / world
        ref_opt.step()
        ref_opt.zero_grad()

    model = make_model()
    opt = shard_and_adamw(model)
    for step in range(2):
        sharded_step(model, opt, step)
        reference_step(step)
    full = {n: ref_opt.state[p] for n, p in ref.named_parameters()}

    def slice_of(t, off, shape):
        for d, (o, n) in enumerate(zip(off, shape, strict=True)):
            t = t.narrow(d, o, n)
        return t

    state_err, kinds = 0.0, set()
    for fqn, entries in fs.sharded_optim_state_dict(model, opt)["state"].items():
        for k, v in entries.items():
            kinds.add(type(v).__name__)
            if isinstance(v, fs.ShardedParam):
                for off, t in v.local_chunks():
                    want = slice_of(full[fqn][k], off, t.shape)
                    if t.numel():
                        state_err = max(state_err, float((t - want).abs().max()))
            else:
                state_err = max(state_err, float((v - full[fqn][k]).abs().max()))

    fresh = make_model(seed=1)  # other weights: everything must come from the "checkpoint"
    fresh_opt = shard_and_adamw(fresh)
    fs.load_full_state_dict(fresh, ref.state_dict())
    fs.init_optim_state(fresh_opt)
    target = fs.sharded_optim_state_dict(fresh, fresh_opt)
    for fqn, entries in target["state"].items():  # fill in place, as a loader would
        for k, v in entries.items():
            if isinstance(v, fs.ShardedParam):
                for off, t in v.local_chunks():
                    t.copy_(slice_of(full[fqn][k], off, t.shape))
            else:
                v.copy_(full[fqn][k])
    fs.load_sharded_optim_state_dict(fresh, fresh_opt, target)
    sharded_step(fresh, fresh_opt, 2)
    reference_step(2)
    resumed = fs.full_state_dict(fresh, rank0_only=False)
    resume_err = max(float((resumed[k] - v).abs().max()) for k, v in ref.state_dict().items())
    return {"state_err": state_err, "resume_err": resume_err, "kinds": sorted(kinds)}


def feature_checks() -> dict[str, Any]:
    return {
        "optim_state": check_optim_state(),
        "ignored": check_ignored_params(),
        "nested": check_nested_full_state_dict(),
        "overlap": check_overlap(),
        "readme": readme_example(),
        "owned_balance": check_owned_balance(),
        "bad_input": check_bad_input(),
        "state_dicts": check_state_dicts(),
        "memory": check_memory(),
        "memory_deep": check_memory(layers=96),
        "fp8": check_fp8(),
    }
