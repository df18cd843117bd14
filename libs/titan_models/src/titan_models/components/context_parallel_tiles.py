"""Tile kernels of the ``context_parallel`` backend: one call computes a (query tile, key
tile) pair and returns its output and log-sum-exp; its backward takes the *final* output and
log-sum-exp of the whole row (as flash attention's backward does), so the tiles' gradients add
up to the exact gradient and nothing but ``q, k, v``, the output and its log-sum-exp is saved.

Kernels (``ContextParallel.tile_kernel``):

- ``sdpa`` (the default: fused on every device without a compile): the flash-attention ops
  that return the log-sum-exp. CPU (and ``meta``, fake mode):
  ``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, GQA native, a
  mask as an additive bias. CUDA: ``aten._scaled_dot_product_flash_attention`` (+ backward;
  16-bit inputs, GQA native) for unmasked tiles and the causal diagonal tiles, and
  ``aten._scaled_dot_product_efficient_attention`` (+ backward) with an additive bias (K/V
  repeated per query head) for other masked tiles and fp32. A masked tile's bias is
  ``finfo.min``, not ``-inf``: a query row that sees no key of the tile then gets a
  log-sum-exp near ``finfo.min`` (weight 0 when merged) instead of the kernels' 0. No soft
  cap: a layer with one runs the ``torch`` kernel. The ops want one head dim: a value dim
  unlike the key's (MLA) is zero-padded per tile.
- ``flex``: ``flex_attention`` with ``return_aux`` and one ``BlockMask`` per tile (built
  once per batch: causal, window and documents as a ``mask_mod``, so masked blocks are
  skipped); the backward is FlexAttention's backward operator
  (``flex_attention_backward``) given the final output and log-sum-exp. Both compiled on
  accelerators (``flex.flex_compile``); un-compiled they materialise the tile's scores. On
  ``meta`` tensors (fake mode; FlexAttention refuses the device) the ``sdpa`` ops model it:
  same outputs, same memory, no scores. A soft cap runs ``torch`` (the backward operator
  cannot trace a soft-cap ``score_mod`` eagerly in torch 2.15).
- ``torch``: about fifteen plain torch ops per tile (scores, mask, softmax), the reference.
  It materialises a tile's scores, so its tiles are bounded by ``ContextParallel.tile_scores``.

Tile sizes (``tile_size``): the fused kernels take whole chunks (``S / (2·cp)`` queries
against a chunk's keys: at 128K CP 8, 17 tiles per layer per rank under a causal mask), except
``sdpa`` under a sliding window, whose dense bias would cost a chunk squared: tiles of
``max(window, 512)`` there.

Shapes: B batch, H query heads, K kv heads, G = H / K, Tq queries of a tile, L keys of a tile,
E q/k head dim, V value dim. Query rows are head-major: ``(B, H, Tq, ·)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

KERNELS = ("torch", "flex", "sdpa")
"""The tile kernels (``ContextParallel.tile_kernel``)."""

WINDOW_TILE = 512
"""Smallest ``sdpa`` tile under a sliding window (tiles are ``max(window, WINDOW_TILE)``)."""

_aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class Tile:
    """Local queries ``[q0, q1)`` against keys ``[k0, k1)`` of a rank's block (each range
    inside one chunk, so its global indices are contiguous)."""

    q0: int
    q1: int
    qg0: int
    """Global index of query ``q0``."""
    k0: int
    k1: int
    kg0: int
    """Global index of key ``k0``."""
    masked: bool
    """Some (query, key) pair of the tile is hidden: build its mask."""
    causal: bool
    """The tile is square on the diagonal (``qg0 == kg0``) and its only mask is causal."""


@dataclass(frozen=True, slots=True)
class TileOptions:
    """What every tile of one attention call shares."""

    kernel: str
    """``torch``, ``flex`` or ``sdpa`` (resolved: see ``resolve_kernel``)."""
    groups: int
    """G: query heads per kv head."""
    scale: float
    softcap: float | None
    window: int | None
    starts: torch.Tensor | None
    """``(B, S)`` global index where each local query's document begins."""
    acc: torch.dtype
    """Merged output, log-sum-exp and gradient accumulators: fp32, or the inputs' dtype when
    wider."""
    block_masks: dict[Tile, Any] | None = None
    """``flex``: each tile's ``BlockMask`` (``flex_block_masks``)."""


def resolve_kernel(kernel: str, device_type: str, softcap: float | None) -> str:
    """The kernel that runs: a soft-capped layer runs ``torch`` (``sdpa`` has no soft cap;
    FlexAttention's backward operator cannot trace a soft-cap ``score_mod`` eagerly in torch
    2.15: "requires the output of score_mod to depend on score"); ``flex`` on ``meta`` tensors
    is modelled by the ``sdpa`` ops (same memory, nothing computed)."""
    if kernel not in KERNELS:
        raise ValueError(f"ContextParallel.tile_kernel={kernel!r} must be one of {list(KERNELS)}")
    if kernel != "torch" and softcap is not None:
        return "torch"
    if kernel == "flex" and device_type == "meta":
        return "sdpa"
    return kernel


def tile_size(
    kernel: str, local_len: int, batch: int, heads: int, window: int | None, tile_scores: int
) -> int:
    """Queries (and keys) per tile for a shard of ``local_len`` tokens: square tiles of at
    most ``tile_scores`` scores for ``torch``; a whole chunk for the fused kernels (they keep
    no scores), ``max(window, WINDOW_TILE)`` for ``sdpa`` under a sliding window."""
    c = local_len // 2
    if kernel == "torch":
        return max(1, min(c, math.isqrt(tile_scores // (batch * heads))))
    if kernel == "sdpa" and window is not None:
        return max(1, min(c, max(window, WINDOW_TILE)))
    return max(1, c)


# --- masks -------------------------------------------------------------------------------------


def visible(tile: Tile, opt: TileOptions, device: torch.device) -> torch.Tensor:
    """``(B or 1, Tq, L)`` True where the query sees the key (causal, window, document)."""
    qi = torch.arange(tile.qg0, tile.qg0 + tile.q1 - tile.q0, device=device)[:, None]
    kj = torch.arange(tile.kg0, tile.kg0 + tile.k1 - tile.k0, device=device)[None, :]
    seen_TL = kj <= qi
    if opt.window is not None:
        seen_TL = seen_TL & (qi - kj < opt.window)
    seen = seen_TL[None]
    if opt.starts is not None:
        seen = seen & (kj[None] >= opt.starts[:, tile.q0 : tile.q1, None])
    return seen


def _bias(tile: Tile, opt: TileOptions, q: torch.Tensor, align: int = 1) -> torch.Tensor:
    """``(B or 1, 1, Tq, L)`` additive mask in ``q``'s dtype: 0 or ``finfo.min`` (a row that
    sees no key keeps a finite log-sum-exp near ``finfo.min``: weight 0 when merged). Its
    rows are padded to a multiple of ``align`` elements (memory-efficient attention's
    alignment) and cut back."""
    seen = visible(tile, opt, q.device)[:, None]
    L = seen.shape[-1]
    padded = -(-L // align) * align
    bias = torch.full(
        (*seen.shape[:-1], padded), torch.finfo(q.dtype).min, dtype=q.dtype, device=q.device
    )[..., :L]
    return bias.masked_fill_(seen, 0.0)


def flex_block_masks(
    plan: list[list[Tile]], window: int | None, starts: torch.Tensor | None, device: Any
) -> dict[Tile, Any]:
    """A ``BlockMask`` for every tile of ``plan`` (built once per batch; offsets are device
    scalars, so the compiled ``create_block_mask`` does not recompile per tile)."""
    from torch.nn.attention.flex_attention import create_block_mask

    from .flex import flex_compile

    build = flex_compile(create_block_mask)
    masks: dict[Tile, Any] = {}
    for tile in (t for step in plan for t in step):
        if tile in masks:
            continue
        qg0 = torch.full((), tile.qg0, dtype=torch.int64, device=device)
        kg0 = torch.full((), tile.kg0, dtype=torch.int64, device=device)
        doc = None if starts is None else starts[:, tile.q0 : tile.q1].contiguous()

        def mask_mod(b, h, q_idx, kv_idx, qg0=qg0, kg0=kg0, doc=doc):
            qi, kj = q_idx + qg0, kv_idx + kg0
            seen = kj <= qi
            if window is not None:
                seen = seen & (qi - kj < window)
            if doc is not None:
                seen = seen & (kj >= doc[b, q_idx])
            return seen

        rows = None if starts is None else starts.shape[0]
        masks[tile] = build(
            mask_mod, rows, None, tile.q1 - tile.q0, tile.k1 - tile.k0, device=device
        )
    return masks


# --- the kernels -------------------------------------------------------------------------------


def forward(
    q_BHTE: torch.Tensor, k_BKLE: torch.Tensor, v_BKLV: torch.Tensor, tile: Tile, opt: TileOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tile's output ``(B, H, Tq, V)`` (normalised over the tile's keys) and log-sum-exp
    ``(B, H, Tq)`` (``-inf`` or near ``finfo.min`` where a row sees no key of the tile)."""
    if opt.kernel == "sdpa":
        return _sdpa_forward(q_BHTE, k_BKLE, v_BKLV, tile, opt)
    if opt.kernel == "flex":
        return _flex_forward(q_BHTE, k_BKLE, v_BKLV, tile, opt)
    return _torch_forward(q_BHTE, k_BKLE, v_BKLV, tile, opt)


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    delta: torch.Tensor | None,
    tile: Tile,
    opt: TileOptions,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one tile from the rows' *final* output ``out``, log-sum-exp
    ``lse`` and output gradient ``do``: ``p = exp(s - lse)`` is the tile's share of the full
    softmax. ``delta`` (``rowsum(do * out)``, in ``opt.acc``) is read by ``torch`` only; the
    fused kernels compute it from ``out``."""
    if opt.kernel == "sdpa":
        return _sdpa_backward(q, k, v, out, lse, do, tile, opt)
    if opt.kernel == "flex":
        return _flex_backward(q, k, v, out, lse, do, tile, opt)
    assert delta is not None
    return _torch_backward(q, k, v, lse, do, delta, tile, opt)


# torch: plain ops, scores materialised ----------------------------------------------------------


def finite(x: torch.Tensor) -> torch.Tensor:
    """``x`` with -inf (rows that see no key) replaced by 0, so exponentials give 0, not nan."""
    return torch.where(x == float("-inf"), 0.0, x)


def _torch_scores(
    q_BHTE: torch.Tensor, k_BKLE: torch.Tensor, tile: Tile, opt: TileOptions
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scores ``(B, K, G, Tq, L)`` (in ``opt.acc``) with the mask applied (-inf), and the
    tanh of the soft cap (for its gradient)."""
    B, H, T, E = q_BHTE.shape
    K = k_BKLE.shape[1]
    q_BKGTE = q_BHTE.reshape(B, K, H // K, T, E)
    s = (q_BKGTE @ k_BKLE[:, :, None].transpose(-1, -2)).to(opt.acc) * opt.scale
    tanh = None
    if opt.softcap is not None:
        tanh = torch.tanh(s / opt.softcap)
        s = opt.softcap * tanh
    if tile.masked:
        seen = visible(tile, opt, s.device)
        s = s.masked_fill(~seen[:, None, None], float("-inf"))
    return s, tanh


def _torch_forward(q, k, v, tile, opt):
    B, H, T, _ = q.shape
    s, _ = _torch_scores(q, k, tile, opt)
    m = finite(s.amax(-1))
    p = torch.exp(s - m[..., None])
    total = p.sum(-1)
    o = (p.to(v.dtype) @ v[:, :, None]).to(opt.acc)  # unnormalised: sum of exp(s - m) v
    o = o / torch.where(total == 0, 1.0, total)[..., None]
    lse = m + torch.log(total)
    return o.reshape(B, H, T, -1), lse.reshape(B, H, T)


def _torch_backward(q, k, v, lse, do, delta, tile, opt):
    B, H, T, E = q.shape
    K = k.shape[1]
    G = H // K
    acc = opt.acc
    s, tanh = _torch_scores(q, k, tile, opt)
    p = torch.exp(s - finite(lse).reshape(B, K, G, T, 1))
    do_BKGTV = do.reshape(B, K, G, T, -1)
    dv = (p.transpose(-1, -2) @ do_BKGTV.to(acc)).sum(2)
    ds = p * ((do_BKGTV @ v[:, :, None].transpose(-1, -2)).to(acc) - delta.reshape(B, K, G, T, 1))
    if tanh is not None:
        ds = ds * (1 - tanh * tanh)
    dq = (ds @ k[:, :, None].to(acc)) * opt.scale
    dk = (ds.transpose(-1, -2) @ q.reshape(B, K, G, T, E).to(acc)).sum(2) * opt.scale
    return dq.reshape(B, H, T, E), dk, dv


# sdpa: the flash / memory-efficient attention ops ------------------------------------------------


def _cuda_flash(q: torch.Tensor, tile: Tile) -> bool:
    """CUDA's flash op runs the tile: 16-bit inputs and no mask but a causal diagonal."""
    return q.dtype in (torch.float16, torch.bfloat16) and (not tile.masked or tile.causal)


def _repeat_heads(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x.repeat_interleave(groups, dim=1) if groups > 1 else x


def _pad(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x if x.shape[-1] == dim else torch.nn.functional.pad(x, (0, dim - x.shape[-1]))


def _sdpa_forward(q, k, v, tile, opt):
    """The flash ops want one head dim: the smaller of E and V is zero-padded (MLA's value
    dim), which changes no score and no output column."""
    V = v.shape[-1]
    D = max(q.shape[-1], V)
    out, lse = _sdpa_ops_forward(_pad(q, D), _pad(k, D), _pad(v, D), tile, opt)
    return out[..., :V], lse


def _sdpa_backward(q, k, v, out, lse, do, tile, opt):
    E, V = q.shape[-1], v.shape[-1]
    D = max(E, V)
    dq, dk, dv = _sdpa_ops_backward(
        _pad(q, D), _pad(k, D), _pad(v, D), _pad(out, D), lse, _pad(do, D), tile, opt
    )
    return dq[..., :E], dk[..., :E], dv[..., :V]


def _sdpa_ops_forward(q, k, v, tile, opt):
    causal = tile.masked and tile.causal
    T = q.shape[2]
    if q.device.type == "cuda":
        if _cuda_flash(q, tile):
            out, lse, *_ = _aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, scale=opt.scale
            )
            return out, lse
        bias = _bias(tile, opt, q, align=16) if tile.masked else None
        k, v = _repeat_heads(k, opt.groups), _repeat_heads(v, opt.groups)
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, False, scale=opt.scale
        )
        return out, lse[..., :T]
    bias = _bias(tile, opt, q) if tile.masked and not tile.causal else None
    return _aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=bias, scale=opt.scale
    )


def _sdpa_ops_backward(q, k, v, out, lse, do, tile, opt):
    causal = tile.masked and tile.causal
    T, L = q.shape[2], k.shape[2]
    if q.device.type == "cuda":
        if _cuda_flash(q, tile):
            seed = torch.empty(2, dtype=torch.uint64, device=q.device)
            offset = torch.empty((), dtype=torch.uint64, device=q.device)
            return _aten._scaled_dot_product_flash_attention_backward(
                do, q, k, v, out, lse, None, None, T, L, 0.0, causal, seed, offset,
                scale=opt.scale,
            )  # fmt: skip
        bias = _bias(tile, opt, q, align=16) if tile.masked else None
        G = opt.groups
        lse_padded = torch.zeros(
            (*lse.shape[:-1], -(-T // 32) * 32), dtype=lse.dtype, device=lse.device
        )
        lse_padded[..., :T] = lse
        seed = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            do, q, _repeat_heads(k, G), _repeat_heads(v, G), bias, out, lse_padded, seed, seed,
            0.0, [True, True, True, False], False, scale=opt.scale,
        )  # fmt: skip
        K = k.shape[1]
        return dq, dk.unflatten(1, (K, G)).sum(2), dv.unflatten(1, (K, G)).sum(2)
    bias = _bias(tile, opt, q) if tile.masked and not tile.causal else None
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do, q, k, v, out, lse, 0.0, causal, attn_mask=bias, scale=opt.scale
    )


# flex: FlexAttention with a BlockMask per tile -------------------------------------------------


def _identity(score, b, h, q_idx, kv_idx):
    return score


def _flex_tile_forward(q, k, v, score_mod, block_mask, scale, gqa):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    out, aux = flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
        return_aux=AuxRequest(lse=True),
    )  # fmt: skip
    return out, aux.lse


def _flex_tile_backward(q, k, v, out, lse, do, score_mod, block_mask, scale):
    from torch._higher_order_ops.flex_attention import flex_attention_backward
    from torch.nn.attention.flex_attention import _apply_kernel_options

    options = dict(_apply_kernel_options(q, k, v, True, None))
    # The operator takes the log-sum-exp in base 2, as its forward returns it; with no joint
    # graph it traces score_mod's own (torch's hint says GraphModule, None is handled).
    dq, dk, dv, _ = flex_attention_backward(
        q, k, v, out, lse / math.log(2), do, None, score_mod,
        None,  # pyrefly: ignore[bad-argument-type]
        block_mask.as_tuple(), scale, options,
    )  # fmt: skip
    return dq, dk, dv


def _flex_forward(q, k, v, tile, opt):
    from .flex import flex_compile

    assert opt.block_masks is not None
    run = flex_compile(_flex_tile_forward)
    # inside autograd.Function.forward the inputs still carry requires_grad: FlexAttention
    # would refuse them on CPU
    return run(
        q.detach(), k.detach(), v.detach(), _identity, opt.block_masks[tile],
        opt.scale, opt.groups > 1,
    )  # fmt: skip


def _flex_backward(q, k, v, out, lse, do, tile, opt):
    from .flex import flex_compile

    assert opt.block_masks is not None
    run = flex_compile(_flex_tile_backward)
    return run(q, k, v, out, lse, do, _identity, opt.block_masks[tile], opt.scale)
