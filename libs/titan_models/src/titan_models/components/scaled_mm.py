"""FP8 / MXFP8 / NVFP4 GEMMs for training: ``x @ w.T`` and its two backward GEMMs, quantised.

For ``y = x @ w.T`` (``x`` (M, K), ``w`` (N, K), ``dy`` (M, N)) the three GEMMs and the axis
each operand is quantised along (always the GEMM's reduction axis):

    forward   y  = Q(x, K)      @ Q(w, K).T           (x, w in e4m3)
    dgrad     dx = Q(dy, N)     @ Q(w.T, N).T         (dy in the recipe's gradient dtype)
    wgrad     dw = Q(dy.T, M)   @ Q(x.T, M).T

with the grouping of :class:`Float8Recipe` (``float8.quantize``: per matrix, per row, or MX
blocks of 32; or ``nvfp4.quantize``: E2M1 in blocks of 16 with e4m3 block scales and an fp32
tensor scale, for every operand, the output gradient included, so ``grad_dtype`` does not
apply; its rounding may be stochastic with ``stochastic_grads``). Per-matrix scales do not depend on the axis, so ``fp8_tensorwise`` quantises
``x``, ``w`` and ``dy`` once and saves the fp8 copies for backward; the other recipes
quantise the saved high-precision tensors again along the backward GEMMs' axes.

Numerics definition (what every path computes): each output element is the sum over the
reduction axis of ``dequantize(a) * dequantize(b)``, products exact, accumulated in fp32,
then cast to the output dtype. ``emulate=True`` (and every device but CUDA) computes exactly
that with dequantised fp32 operands (bf16 on CUDA for grouped GEMMs, where fp32 grouped GEMM
is unavailable: dequantised values are exact in bf16); on CUDA the device path feeds the fp8
tensors and scales to ``torch.nn.functional.scaled_mm`` (tensorwise, rowwise, MX
``BlockWise1x32`` with swizzled e8m0 scales, NVFP4 ``float4_e2m1fn_x2`` with ``BlockWise1x16``
swizzled e4m3 scales and the two tensor scales) or ``scaled_grouped_mm`` (rowwise: the
tensorwise recipe passes its scales broadcast per row). The quantisation itself is the same
torch code on every device, so only the accumulation order of the GEMM differs.

Grouped GEMMs (routed experts): ``x`` (R, K) rows grouped by expert (``offs`` = int32 group
ends, rows past ``offs[-1]`` are slack and ignored), ``w`` (E, N, K). Per-matrix and
per-row scales are per expert for ``w``; for ``wgrad`` (reduction over each expert's rows)
rowwise scales are per (expert, column) and MX blocks are 32 rows of one expert, which needs
every group padded to a multiple of 32 rows (``dist_moe.PermuteConfig.alignment``). NVFP4
has no grouped GEMM yet (``ValueError``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal, cast

import torch
import torch.nn.functional as F

from . import nvfp4
from .float8 import E4M3, E5M2, MX_BLOCK, Granularity, dequantize, quantize, to_e8m0

__all__ = [
    "MODES",
    "Float8Recipe",
    "check_device_support",
    "scaled_grouped_linear",
    "scaled_linear",
]

MODES: dict[str, str] = {
    "fp8_tensorwise": "tensor",
    "fp8_rowwise": "axis",
    "mxfp8": "block",
    "nvfp4": "nvfp4",
}
"""Recipe name -> grouping of the scales (``float8.Granularity``, or NVFP4's own)."""
GRAD_DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


@dataclasses.dataclass(frozen=True, slots=True)
class Float8Recipe:
    """How the forward and both backward GEMMs of a layer are quantised."""

    mode: Literal["fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4"]
    """Grouping of the scales: one per matrix, per row, or per 32-element MX block (fp8); or
    NVFP4 (E2M1 elements, an e4m3 scale per 16, an fp32 scale per tensor)."""
    grad_dtype: Literal["e4m3", "e5m2"] = "e4m3"
    """fp8 format of the output gradient in the two backward GEMMs (inputs and weights are
    always e4m3); fp8 recipes only (nvfp4 gradients are NVFP4: leave it at e4m3)."""
    stochastic_grads: bool = False
    """nvfp4 only: round the output gradient stochastically (unbiased) in the backward GEMMs;
    weights and activations always round to nearest even."""
    emulate: bool = False
    """Dequantise and multiply in fp32 on every device (the CPU always does)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Float8Recipe.mode must be one of {sorted(MODES)}, got {self.mode!r}")
        if self.grad_dtype not in GRAD_DTYPES:
            raise ValueError(
                f"Float8Recipe.grad_dtype must be one of {sorted(GRAD_DTYPES)}, "
                f"got {self.grad_dtype!r}"
            )
        if self.mode == "nvfp4" and self.grad_dtype != "e4m3":
            raise ValueError(
                f"Float8Recipe.grad_dtype={self.grad_dtype!r} applies to the fp8 recipes; nvfp4 "
                "quantises gradients to NVFP4 like every operand (leave it at 'e4m3')"
            )
        if self.stochastic_grads and self.mode != "nvfp4":
            raise ValueError(
                f"Float8Recipe.stochastic_grads=True is an nvfp4 option, got mode={self.mode!r}"
            )

    @property
    def granularity(self) -> str:
        """``"tensor"``, ``"axis"``, ``"block"`` or ``"nvfp4"``."""
        return MODES[self.mode]

    @property
    def multiple(self) -> int:
        """What every GEMM dimension of a weight must be a multiple of: 16 for the device's
        fp8 kernels and NVFP4 blocks, 32 for MX blocks."""
        return MX_BLOCK if self.mode == "mxfp8" else 16


def check_device_support(recipe: Float8Recipe, device: torch.device, *, grouped: bool) -> None:
    """``ValueError`` if ``device`` cannot run ``recipe``'s GEMMs (CUDA without the needed fp8
    kernels; MX grouped GEMMs have no device path yet; NVFP4 needs sm100 and a torch with
    ``float4_e2m1fn_x2``). Emulation runs everywhere (but NVFP4 has no grouped GEMM at all)."""
    what = "grouped expert GEMMs" if grouped else "linear GEMMs"
    if grouped and recipe.mode == "nvfp4":
        raise ValueError(f"nvfp4 {what} are not supported (emulated or not): use an fp8 recipe")
    if recipe.emulate or device.type != "cuda":
        return
    hint = "(use emulation: --quantize.kernels emulated)"
    if recipe.mode == "nvfp4":
        cap = torch.cuda.get_device_capability(device)
        if not hasattr(torch, "float4_e2m1fn_x2"):
            raise ValueError(f"nvfp4 {what} need a torch with float4_e2m1fn_x2 {hint}")
        if cap[0] != 10:
            raise ValueError(
                f"nvfp4 {what} need a CUDA device of compute capability 10.x (sm100), this one "
                f"is {cap[0]}.{cap[1]} {hint}"
            )
        return
    if grouped and recipe.mode == "mxfp8":
        raise ValueError(f"mxfp8 {what} have no CUDA kernel path here yet {hint}")
    cap = torch.cuda.get_device_capability(device)
    need = {"fp8_tensorwise": (8, 9), "fp8_rowwise": (9, 0), "mxfp8": (10, 0)}[recipe.mode]
    if grouped:
        need = max(need, (9, 0))
    if cap < need:
        raise ValueError(
            f"{recipe.mode} {what} need a CUDA device of compute capability >= "
            f"{need[0]}.{need[1]}, this one is {cap[0]}.{cap[1]} {hint}"
        )


# --- quantised operands ----------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class _Operand:
    """A quantised GEMM operand ``(rows, reduction)`` with its scales (``float8.quantize``
    shapes, along the last axis; NVFP4: packed codes, e4m3 block scales and the tensor
    scale, or for the emulation only the dequantised ``values``)."""

    q: torch.Tensor | None
    scale: torch.Tensor | None
    granularity: str
    tensor_scale: torch.Tensor | None = None
    values: torch.Tensor | None = None

    @classmethod
    def of(
        cls,
        x: torch.Tensor,
        dtype: torch.dtype,
        granularity: str,
        recipe: Float8Recipe,
        stochastic: bool = False,
    ) -> _Operand:
        if granularity == "nvfp4" and not _device(x, recipe):  # codes would only be unpacked
            return cls(None, None, "nvfp4", values=nvfp4.round_trip(x, stochastic=stochastic))
        if granularity == "nvfp4":
            q, s, t = nvfp4.quantize(x, stochastic=stochastic)
            return cls(q, s, "nvfp4", t)
        q, s = quantize(x, dtype, cast(Granularity, granularity), axis=-1)
        return cls(q, s, granularity)

    def dequantized(self) -> torch.Tensor:
        if self.values is not None:
            return self.values
        assert self.q is not None and self.scale is not None  # quantised (no values)
        if self.granularity == "nvfp4":
            assert self.tensor_scale is not None
            return nvfp4.dequantize(self.q, self.scale, self.tensor_scale)
        return dequantize(self.q, self.scale, cast(Granularity, self.granularity), axis=-1)

    @property
    def T(self) -> _Operand:  # as Tensor.T; per-matrix scales only
        assert self.granularity == "tensor" and self.q is not None
        return _Operand(self.q.transpose(-2, -1), self.scale, "tensor")


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    """Zero-pad the reduction axis to a multiple of the MX / NVFP4 block (zeros add nothing to
    a sum and change neither a block's amax nor the tensor's)."""
    rem = x.shape[-1] % multiple
    return F.pad(x, (0, multiple - rem)) if rem else x


def _swizzled(scale: torch.Tensor) -> torch.Tensor:
    """Block scales (rows, K / block) in the layout cuBLAS reads: MX as e8m0, NVFP4 (already
    e4m3) as they are; the matrix padded to 128 x 4 tiles, each stored as (32, 4, 4) =
    (row % 32, row // 32, column)."""
    rows, cols = scale.shape
    r, c = -(-rows // 128) * 128, -(-cols // 4) * 4
    dtype = scale.dtype if scale.dtype == torch.float8_e4m3fn else torch.float8_e8m0fnu
    codes = scale if dtype == scale.dtype else to_e8m0(scale)
    bits = torch.zeros(r, c, dtype=torch.uint8, device=scale.device)
    bits[:rows, :cols] = codes.view(torch.uint8)
    tiles = bits.view(r // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.reshape(-1).view(dtype)


def _device(a: torch.Tensor, recipe: Float8Recipe) -> bool:
    return not recipe.emulate and a.device.type == "cuda"


def _mm(a: _Operand, b: _Operand, recipe: Float8Recipe, out_dtype: torch.dtype) -> torch.Tensor:
    """``deq(a) @ deq(b).T`` for a (M, K), b (N, K) (see the module doc for the numerics)."""
    if a.q is None or not _device(a.q, recipe):
        return (a.dequantized() @ b.dequantized().T).to(out_dtype)
    assert a.scale is not None and b.q is not None and b.scale is not None  # both quantised
    st, sw = F.ScalingType, F.SwizzleType
    if a.granularity == "nvfp4":  # sm100: E2M1 pairs, swizzled e4m3 blocks, then the tensors'
        fp4 = torch.float4_e2m1fn_x2
        assert a.tensor_scale is not None and b.tensor_scale is not None
        qa, qb = a.q.contiguous().view(fp4), b.q.contiguous().view(fp4).T
        kinds = [st.BlockWise1x16, st.TensorWise]
        swz = [sw.SWIZZLE_32_4_4, sw.NO_SWIZZLE]
        sa = [_swizzled(a.scale), a.tensor_scale.reshape(1)]
        sb = [_swizzled(b.scale), b.tensor_scale.reshape(1)]
        return F.scaled_mm(qa, qb, sa, kinds, sb, kinds, swz, swz, output_dtype=out_dtype)
    qa, qb = a.q.contiguous(), b.q.contiguous().T  # scaled_mm: a row-major, b column-major
    if a.granularity == "block":
        sa, sb, kind, swz = (
            _swizzled(a.scale),
            _swizzled(b.scale),
            st.BlockWise1x32,
            sw.SWIZZLE_32_4_4,
        )
        return F.scaled_mm(qa, qb, sa, kind, sb, kind, swz, swz, output_dtype=out_dtype)
    if a.granularity == "axis":
        sa, sb, kind = a.scale.reshape(-1, 1), b.scale.reshape(1, -1), st.RowWise
    else:
        sa, sb, kind = a.scale.reshape(()), b.scale.reshape(()), st.TensorWise
    return F.scaled_mm(qa, qb, sa, kind, sb, kind, output_dtype=out_dtype)


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32


class _ScaledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, recipe: Float8Recipe) -> torch.Tensor:
        g = recipe.granularity
        xq, wq = _Operand.of(x, E4M3, g, recipe), _Operand.of(w, E4M3, g, recipe)
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, w.dtype)
        if g == "tensor":  # the scale of a matrix is that of its transpose: keep the fp8 copies
            ctx.save_for_backward(xq.q, xq.scale, wq.q, wq.scale)
        else:
            ctx.save_for_backward(x, w)
        return _mm(xq, wq, recipe, _out_dtype(x))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        recipe = ctx.recipe
        g, gd = recipe.granularity, GRAD_DTYPES[recipe.grad_dtype]
        x_dtype, w_dtype = ctx.dtypes
        if g == "tensor":
            xq_q, xq_s, wq_q, wq_s = ctx.saved_tensors
            xq, wq = _Operand(xq_q, xq_s, g), _Operand(wq_q, wq_s, g)
            dq = _Operand.of(dy, gd, g, recipe)
            dx = _mm(dq, wq.T, recipe, x_dtype)
            dw = _mm(dq.T, xq.T, recipe, w_dtype)
            return dx, dw, None
        x, w = ctx.saved_tensors
        sr = recipe.stochastic_grads
        dx = _mm(
            _Operand.of(dy, gd, g, recipe, sr), _Operand.of(w.T, E4M3, g, recipe), recipe, x_dtype
        )
        block = {"block": MX_BLOCK, "nvfp4": nvfp4.NVFP4_BLOCK}.get(g, 1)
        dyt, xt = _pad_last(dy.T, block), _pad_last(x.T, block)
        dw = _mm(
            _Operand.of(dyt, gd, g, recipe, sr), _Operand.of(xt, E4M3, g, recipe), recipe, w_dtype
        )
        return dx, dw, None


def scaled_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Float8Recipe) -> torch.Tensor:
    """``x @ weight.T`` (``x`` (..., K), ``weight`` (N, K)) with the forward and both backward
    GEMMs quantised by ``recipe``; output in ``x``'s dtype."""
    if x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"scaled_linear: x (..., {x.shape[-1]}) and weight {tuple(weight.shape)} disagree"
        )
    y = _ScaledLinear.apply(x.reshape(-1, x.shape[-1]), weight, recipe)
    return y.view(*x.shape[:-1], weight.shape[0])


# --- grouped GEMMs (experts) -----------------------------------------------------------------


def _grouped(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """fp32-accumulated grouped GEMM of dequantised operands (fp8 x 2^k values are exact in
    bf16, which CUDA's grouped GEMM needs)."""
    if a.device.type == "cuda":
        return F.grouped_mm(a.bfloat16(), b.bfloat16(), offs=offs, out_dtype=torch.float32)
    return F.grouped_mm(a, b, offs=offs)


def _valid_rows(x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``x`` with the slack rows past the last group zeroed (they may hold anything)."""
    valid = torch.arange(x.shape[0], device=x.device) < offs[-1]
    return torch.where(valid[:, None], x, torch.zeros((), dtype=x.dtype, device=x.device))


def _group_ids(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert of each row (``len(offs)`` for slack rows)."""
    return torch.searchsorted(
        offs, torch.arange(rows, device=offs.device, dtype=offs.dtype), right=True
    )


def _per_group_columns(t: torch.Tensor, gid: torch.Tensor, groups: int, dtype: torch.dtype):
    """Rowwise wgrad operand: ``t`` (R, C) scaled per (group, column) over the group's rows;
    returns (q, per-row scales (R, C))."""
    from .float8 import pow2_scale

    amax = t.new_zeros(groups + 1, t.shape[1]).float()
    idx = gid[:, None].expand(-1, t.shape[1]).long()
    amax = amax.scatter_reduce(0, idx, t.float().abs(), "amax", include_self=True)
    scale = pow2_scale(amax, dtype).index_select(0, gid.long())
    return (t.float() / scale).to(dtype), scale


def _grouped_device(a: _Operand, b: _Operand, offs: torch.Tensor, out_dtype: torch.dtype):
    """``scaled_grouped_mm`` with rowwise scales: a (R, K), b (E, N, K)."""
    st = F.ScalingType
    assert a.q is not None and a.scale is not None and b.q is not None and b.scale is not None
    rows, (experts, n, _) = a.q.shape[0], b.q.shape
    sa = a.scale.reshape(-1).expand(rows) if a.granularity == "tensor" else a.scale.reshape(rows)
    sb = b.scale.reshape(experts, -1).expand(experts, n)
    qb = b.q.contiguous().transpose(-2, -1)  # (E, K, N), column-major per expert
    return F.scaled_grouped_mm(  # pyrefly: ignore[missing-attribute]  # not in functional.pyi
        a.q.contiguous(),
        qb,
        sa.contiguous(),
        st.RowWise,
        sb.contiguous(),
        st.RowWise,
        offs=offs,
        output_dtype=torch.bfloat16,
    ).to(out_dtype)


def _gmm(a: _Operand, b: _Operand, offs, recipe: Float8Recipe, out_dtype) -> torch.Tensor:
    """Per group: ``deq(a)[rows of e] @ deq(b)[e].T``."""
    if a.q is not None and _device(a.q, recipe):
        return _grouped_device(a, b, offs, out_dtype)
    return _grouped(a.dequantized(), b.dequantized().transpose(-2, -1), offs).to(out_dtype)


class _ScaledGroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, recipe: Float8Recipe):
        g = recipe.granularity
        x = _valid_rows(x, offs)
        xq, wq = _Operand.of(x, E4M3, g, recipe), _Operand.of(w, E4M3, g, recipe)
        ctx.recipe, ctx.dtypes = recipe, (x.dtype, w.dtype)
        ctx.save_for_backward(x, w, offs)
        return _gmm(xq, wq, offs, recipe, _out_dtype(x))

    @staticmethod
    def backward(ctx, dy):  # pyrefly: ignore[bad-override]  # torch: one arg per output
        recipe = ctx.recipe
        g, gd = recipe.granularity, GRAD_DTYPES[recipe.grad_dtype]
        x, w, offs = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        dy = _valid_rows(dy, offs)
        dq = _Operand.of(dy, gd, g, recipe)
        wt = _Operand(*quantize(w.transpose(-2, -1), E4M3, g, axis=-1), g)  # along N
        dx = _gmm(dq, wt, offs, recipe, x_dtype)
        # wgrad: per expert, dy_e.T @ x_e, reduced over the expert's rows (dequantised
        # operands: the same definition on every device)
        if g == "tensor":  # a matrix's scale is that of its transpose
            a, b = dq.dequantized(), _Operand.of(x, E4M3, g, recipe).dequantized()
        elif g == "axis":
            gid = _group_ids(offs, x.shape[0])
            qa, sa = _per_group_columns(dy, gid, offs.shape[0], gd)
            qb, sb = _per_group_columns(x, gid, offs.shape[0], E4M3)
            a, b = qa.float() * sa, qb.float() * sb
        else:
            a = dequantize(*quantize(dy, gd, "block", axis=0), "block", axis=0)
            b = dequantize(*quantize(x, E4M3, "block", axis=0), "block", axis=0)
        dw = _grouped(a.T, b, offs).to(w_dtype)
        return dx, dw, None, None


def scaled_grouped_linear(
    x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, recipe: Float8Recipe
) -> torch.Tensor:
    """Per expert ``e``: rows ``[offs[e-1], offs[e])`` of ``x`` (R, K) times ``weight[e].T``
    (``weight`` (E, N, K)), every GEMM quantised by ``recipe``; slack rows of the output are
    unspecified (as with ``torch._grouped_mm``)."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(
            f"scaled_grouped_linear: x (R, K) and weight (E, N, K) expected, got "
            f"{tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if recipe.mode == "nvfp4":
        raise ValueError("scaled_grouped_linear: nvfp4 has no grouped GEMM; use an fp8 recipe")
    if recipe.mode == "mxfp8" and x.shape[0] % MX_BLOCK:
        raise ValueError(
            f"scaled_grouped_linear: mxfp8 needs expert groups padded to multiples of "
            f"{MX_BLOCK} rows (dist_moe.PermuteConfig.alignment), got {x.shape[0]} rows"
        )
    return _ScaledGroupedLinear.apply(x, weight, offs.to(torch.int32), recipe)
