"""Distributed Muon (with AdamW for the parameters Muon should not touch).

Muon (Jordan et al., 2024) orthogonalises each matrix's momentum update with a quintic
Newton–Schulz iteration. This implementation follows ``torch.optim.Muon`` exactly on one
device (same momentum/Nesterov formula, same bf16 Newton–Schulz, same shape-based learning
rate adjustment, decoupled weight decay) and adds what sharding needs:

* ``Owned`` parameters: the owner holds the whole matrix *and* its whole gradient, so it
  runs Newton–Schulz locally — no communication in the optimizer step at all. Ranks that
  do not own a matrix skip it; owners are balanced by ``Owned(balance="flops")``.
* ``Shard`` / ``BlockShard`` parameters (the baseline): the momentum update is computed on
  the shard, all-gathered (one collective per bucket, all buckets issued before the first
  wait), orthogonalised in full on every rank, and each rank keeps its own part.
* ``Replicate`` and unsharded parameters: orthogonalised locally.

Parameters in groups with ``use_muon=False`` (default for tensors whose *global* shape is
not 2-D) are updated with AdamW (decoupled weight decay) using the group's ``lr``,
``weight_decay``, ``betas`` and ``adamw_eps``. Every update is elementwise on local shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, overload

import torch
from torch.optim import Optimizer

from flexshard._layout import CommStats
from flexshard._runtime import param_info
from flexshard.placements import Owned, Replicate

__all__ = ["Muon", "adjust_lr", "zeropower_via_newtonschulz"]

DEFAULT_NS = (3.4445, -4.7750, 2.0315)


def zeropower_via_newtonschulz(
    g: torch.Tensor,
    ns_coefficients: tuple[float, float, float] = DEFAULT_NS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Approximately ``U V^T`` for ``g = U S V^T`` (singular values land in ~[0.7, 1.2]),
    by ``ns_steps`` iterations of ``X <- a X + (b A + c A^2) X`` with ``A = X X^T``, after
    scaling ``X`` to Frobenius norm 1 (so the spectral norm is <= 1). Same operations as
    ``torch.optim.Muon`` for ``dtype=torch.bfloat16``."""
    if g.dim() != 2:
        raise ValueError(f"Newton–Schulz needs a 2-D matrix, got shape {tuple(g.shape)}")
    a, b, c = ns_coefficients
    x = g.to(dtype=dtype, copy=True)
    tall = g.size(0) > g.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, upd, x, beta=a)
    if tall:
        x = x.T
    return x


def adjust_lr(lr: float, adjust_lr_fn: str | None, shape: tuple[int, ...]) -> float:
    """Shape-based learning-rate adjustment of ``torch.optim.Muon`` (``A, B = shape[:2]``)."""
    A, B = shape[0], math.prod(shape[1:])
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = math.sqrt(A / B)
    else:
        ratio = 1.0
    return lr * ratio


def _global_shape(p: torch.Tensor) -> tuple[int, ...]:
    info = param_info(p)
    return tuple(info.shape) if info is not None else tuple(p.shape)


class Muon(Optimizer):
    """Muon for matrices, AdamW for the rest, on flexshard-sharded (or plain) parameters.

    Groups may set ``use_muon`` (default: the parameter's global shape is 2-D; in a group
    without the key, every parameter is classified on its own). Muon hyper-parameters
    match ``torch.optim.Muon``; AdamW ones are ``betas``, ``adamw_eps`` and the group's
    ``lr``/``weight_decay``. ``ns_dtype`` is the Newton–Schulz dtype (bf16 like torch;
    float32 for a tighter result). ``comm`` counts the bytes the sharded baseline gathers.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype = torch.bfloat16,
        betas: tuple[float, float] = (0.9, 0.999),
        adamw_eps: float = 1e-8,
    ) -> None:
        if lr < 0:
            raise ValueError(f"Muon: lr must be >= 0, got {lr}")
        if momentum < 0:
            raise ValueError(f"Muon: momentum must be >= 0, got {momentum}")
        if weight_decay < 0:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw", "spectral_unclamped"):
            raise ValueError(
                f"Muon: adjust_lr_fn must be None, 'original', 'match_rms_adamw' or "
                f"'spectral_unclamped', got {adjust_lr_fn!r}"
            )
        if not 1 <= ns_steps < 100:
            raise ValueError(f"Muon: ns_steps must be in [1, 99], got {ns_steps}")
        defaults = dict(
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            ns_dtype=ns_dtype,
            betas=tuple(betas),
            adamw_eps=adamw_eps,
        )
        super().__init__(params, defaults)
        self.comm = CommStats()
        for group in self.param_groups:
            if group.get("use_muon"):
                for p in group["params"]:
                    if len(_global_shape(p)) < 2:
                        raise ValueError(
                            f"Muon: a use_muon=True group holds a parameter of global shape "
                            f"{_global_shape(p)}; Muon needs matrices (>= 2-D)"
                        )

    def _is_muon(self, group: dict, p: torch.Tensor) -> bool:
        use = group.get("use_muon")
        return len(_global_shape(p)) == 2 if use is None else bool(use)

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_work: list[tuple[dict, torch.Tensor, torch.Tensor]] = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if self._is_muon(group, p):
                    muon_work.append((group, p, self._momentum(group, p)))
                else:
                    self._adamw(group, p)
        self._muon_updates(muon_work)
        return loss

    # -- AdamW ---------------------------------------------------------------------------
    def _adamw(self, group: dict, p: torch.Tensor) -> None:
        g = p.grad
        st = self.state[p]
        if "step" not in st:
            st["step"] = 0
            st["exp_avg"] = torch.zeros_like(p)
            st["exp_avg_sq"] = torch.zeros_like(p)
        st["step"] += 1
        beta1, beta2 = group["betas"]
        lr, wd = group["lr"], group["weight_decay"]
        p.mul_(1 - lr * wd)
        st["exp_avg"].lerp_(g, 1 - beta1)
        st["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bc1 = 1 - beta1 ** st["step"]
        bc2 = 1 - beta2 ** st["step"]
        denom = (st["exp_avg_sq"].sqrt() / math.sqrt(bc2)).add_(group["adamw_eps"])
        p.addcdiv_(st["exp_avg"], denom, value=-lr / bc1)

    # -- Muon ----------------------------------------------------------------------------
    def _momentum(self, group: dict, p: torch.Tensor) -> torch.Tensor:
        g = p.grad
        assert g is not None  # step skips parameters without a gradient
        st = self.state[p]
        if "momentum_buffer" not in st:
            st["momentum_buffer"] = torch.zeros_like(g)
        buf = st["momentum_buffer"]
        mu = group["momentum"]
        buf.lerp_(g, 1 - mu)
        return g.lerp(buf, mu) if group["nesterov"] else buf

    def _ns(self, group: dict, full_update: torch.Tensor) -> torch.Tensor:
        shape = full_update.shape
        o = zeropower_via_newtonschulz(
            full_update.reshape(shape[0], -1),
            group["ns_coefficients"],
            group["ns_steps"],
            group["eps"],
            group["ns_dtype"],
        )
        return o.reshape(shape)

    def _apply(self, group: dict, p: torch.Tensor, o: torch.Tensor, shape) -> None:
        lr = group["lr"]
        p.mul_(1 - lr * group["weight_decay"])
        p.add_(o.to(p.dtype), alpha=-adjust_lr(lr, group["adjust_lr_fn"], tuple(shape)))

    def _muon_updates(self, work: list[tuple[dict, torch.Tensor, torch.Tensor]]) -> None:
        by_bucket: dict[int, tuple[Any, dict[int, tuple[dict, torch.Tensor, torch.Tensor]]]] = {}
        for group, p, upd in work:
            info = param_info(p)
            if info is None or (isinstance(info.placement, Replicate) and info.dtensor is None):
                self._apply(group, p, self._ns(group, upd), p.shape)
            elif isinstance(info.placement, Owned):
                if info.owner == info.bucket.state.g.rank:
                    self._apply(group, p, self._ns(group, upd.view(info.shape)), info.shape)
            else:
                b = info.bucket
                by_bucket.setdefault(id(b), (b, {}))[1][info.index] = (group, p, upd)
        # Sharded baseline: gather each bucket's updates (all issued first), orthogonalise
        # the full matrices, keep the local part.
        pending = []
        for b, items in by_bucket.values():
            locals_ = [
                items[i][2].float()
                if i in items
                else torch.zeros_like(info.local, dtype=torch.float32)
                for i, info in enumerate(b.infos)
            ]
            flat = torch.empty(b.layout.full_numel, dtype=torch.float32, device=b.device)
            pending.append(
                (
                    b,
                    items,
                    flat,
                    b.layout.issue_gather(locals_, flat, torch.float32, None, self.comm),
                )
            )
        for b, items, flat, pend in pending:
            b.layout.finish_gather(pend, flat)
            for i, (group, p, _) in sorted(items.items()):
                info = b.infos[i]
                full = self._ns(group, b.layout.out_view(flat, i))
                self._apply(group, p, b.layout.local_from_full(i, full), info.shape)
