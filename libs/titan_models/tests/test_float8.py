"""FP8 / MXFP8 codec and GEMMs against an independent reference written from the formats.

The reference decodes every fp8 code from its bit layout (sign, exponent, mantissa, bias;
e4m3fn: no infinities, S.1111.111 is NaN; e5m2: IEEE-like), rounds to nearest with ties to
the even code, and picks each group's scale as the smallest power of two 2^k (exact rational
arithmetic) with amax / 2^k <= the format's largest value, k in e8m0's [-127, 127]. GEMMs are
summed in float64 from the reference's dequantised operands.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from titan_models.components.float8 import (
    E4M3,
    E5M2,
    check_finite,
    dequantize,
    quantization_error_bound,
    quantize,
    to_e8m0,
)
from titan_models.components.scaled_mm import (
    Float8Recipe,
    scaled_grouped_linear,
    scaled_linear,
)

DTYPES = {"e4m3": E4M3, "e5m2": E5M2}


# --- the reference -------------------------------------------------------------------------


def _grid(dtype: torch.dtype) -> np.ndarray:
    """Every non-negative finite value of the format, in code order (= increasing)."""
    ebits, mbits, bias = (4, 3, 7) if dtype == E4M3 else (5, 2, 15)
    vals = []
    for e in range(2**ebits):
        for m in range(2**mbits):
            if dtype == E4M3 and e == 15 and m == 7:
                continue  # NaN
            if dtype == E5M2 and e == 31:
                continue  # inf / NaN
            if e == 0:
                vals.append(m / 2**mbits * 2.0 ** (1 - bias))
            else:
                vals.append((1 + m / 2**mbits) * 2.0 ** (e - bias))
    return np.array(vals)


def _round_ref(v: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    grid = _grid(dtype)
    a = np.abs(v)
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo = hi - 1
    dlo, dhi = a - grid[lo], grid[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return np.sign(v) * grid[pick]


def _scale_ref(amax: float, dtype: torch.dtype) -> float:
    if amax == 0:
        return 1.0
    ratio = Fraction(amax) / Fraction(_grid(dtype)[-1])
    k = -200
    while Fraction(2) ** k < ratio:
        k += 1
    return 2.0 ** min(max(k, -127), 127)


def _qdq_ref(x: np.ndarray, dtype: torch.dtype, granularity: str, axis: int = -1) -> np.ndarray:
    """Reference quantise-dequantise of a 2-D array along ``axis``."""
    x = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    out = np.empty_like(x)
    rows, n = x.shape
    if granularity == "tensor":
        groups = [(slice(None), slice(None))]
    elif granularity == "axis":
        groups = [(r, slice(None)) for r in range(rows)]
    else:
        groups = [(r, slice(b, b + 32)) for r in range(rows) for b in range(0, n, 32)]
    for g in groups:
        if x[g].size == 0:
            continue
        s = _scale_ref(float(np.abs(x[g]).max()), dtype)
        out[g] = _round_ref(x[g] / s, dtype) * s
    return np.moveaxis(out, -1, axis)


def _qdq(x: torch.Tensor, dtype, granularity, axis=-1) -> torch.Tensor:
    return dequantize(*quantize(x, dtype, granularity, axis), granularity, axis)


def _wide_random(shape, seed: int) -> torch.Tensor:
    """Magnitudes spread over many binades, with subnormal-range elements and exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-12, 12, shape, generator=g))
    x[0, :3] = 0.0
    return x


# --- the codec -------------------------------------------------------------------------------


@pytest.mark.parametrize("granularity", ["tensor", "axis", "block"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_quantize_matches_the_reference_from_the_format_spec(fmt, granularity):
    dtype = DTYPES[fmt]
    x = _wide_random((6, 96), seed=1)
    for axis in (-1, 0) if granularity != "block" else (-1,):
        got = _qdq(x, dtype, granularity, axis).double().numpy()
        assert np.array_equal(got, _qdq_ref(x.double().numpy(), dtype, granularity, axis))


@pytest.mark.parametrize("granularity", ["tensor", "axis", "block"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_representable_values_round_trip_exactly(fmt, granularity):
    dtype = DTYPES[fmt]
    grid = torch.tensor(_grid(dtype), dtype=torch.float32)
    n = 32 * math.ceil((len(grid) + 1) / 32)
    row = torch.zeros(n)
    row[: len(grid)] = grid
    row = row.view(-1, 32)
    row[:, -1] = grid[-1]  # every block holds the format's largest value: its scale is 1
    for k in (-120, -7, 0, 5, 100):  # the same values scaled by 2^k
        x = torch.stack([row.flatten(), -row.flatten()]) * 2.0**k
        q, s = quantize(x, dtype, granularity)
        assert torch.equal(dequantize(q, s, granularity), x)
        assert bool((s == 2.0**k).all())


@pytest.mark.parametrize("granularity", ["tensor", "axis", "block"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_error_within_the_stated_bound_and_the_bound_is_tight(fmt, granularity):
    dtype = DTYPES[fmt]
    x = _wide_random((16, 256), seed=2)
    err = (_qdq(x, dtype, granularity) - x).abs()
    bound = quantization_error_bound(x, dtype, granularity)
    assert bool((err <= bound).all())
    assert (err / bound).max() > 0.5  # the bound is not vacuous


def test_e8m0_scale_edge_cases():
    def scale(amax: float, dtype=E4M3) -> float:
        x = torch.tensor([[amax] + [0.0] * 31])
        return float(quantize(x, dtype, "block")[1])

    assert scale(448.0 * 2**-3) == 2**-3  # amax / 448 a power of two: not rounded up
    above = float(torch.nextafter(torch.tensor(56.0), torch.tensor(99.0)))  # next fp32
    assert scale(above) == 2**-2  # just above: the next power
    assert scale(57344.0, E5M2) == 1.0 and scale(57345.0, E5M2) == 2.0
    assert scale(0.0) == 1.0  # an all-zero block
    assert scale(1e-45) == 2**-127  # below e8m0's range: clamped, the value flushes to 0
    assert scale(3e38) == 2**120  # 3e38 = 1.76 * 2^127 > 1.75 * 2^8 * 2^119: fits
    s = torch.tensor([2.0**-127, 1.0, 2.0**127, float("nan")])
    assert to_e8m0(s).view(torch.uint8).tolist() == [0, 127, 254, 255]
    assert torch.equal(to_e8m0(s[:3]).float(), s[:3])


def test_nonfinite_inputs_poison_only_their_group():
    x = torch.randn(2, 96)
    x[0, 5], x[1, 70] = float("inf"), float("nan")
    y = _qdq(x, E4M3, "block")
    assert bool(y[0, :32].isnan().all()) and bool(y[1, 64:].isnan().all())
    clean = torch.ones_like(x, dtype=torch.bool)
    clean[0, :32], clean[1, 64:] = False, False
    assert torch.equal(y[clean], _qdq(torch.where(clean, x, 0.0), E4M3, "block")[clean])
    assert bool(_qdq(x, E4M3, "tensor").isnan().all())  # one scale: the whole tensor
    with pytest.raises(ValueError, match="non-finite"):
        check_finite(x, "x")


def test_bad_codec_input_is_rejected():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.ones(4, 48), E4M3, "block")
    with pytest.raises(ValueError, match="granularity"):
        quantize(torch.ones(4, 32), E4M3, "row")
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        quantize(torch.ones(4, 32), torch.bfloat16, "axis")
    with pytest.raises(ValueError, match="mode"):
        Float8Recipe("fp4")
    with pytest.raises(ValueError, match="grad_dtype"):
        Float8Recipe("mxfp8", grad_dtype="e3m4")


# --- the GEMMs -------------------------------------------------------------------------------

MODES = [("fp8_tensorwise", "tensor"), ("fp8_rowwise", "axis"), ("mxfp8", "block")]


def _ref_mm(a: np.ndarray, b: np.ndarray, adt, bdt, g: str) -> np.ndarray:
    """``a @ b.T``, both quantised along their last axis, summed in float64."""
    return _qdq_ref(a, adt, g) @ _qdq_ref(b, bdt, g).T


def _close(got: torch.Tensor, want: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Equal up to fp32 accumulation: |err| <= K * 2^-23 * sum |a| |b|."""
    scale = np.abs(a) @ np.abs(b).T
    err = np.abs(got.double().numpy() - want)
    assert (err <= a.shape[1] * 2.0**-23 * scale + 1e-30).all(), err.max()


@pytest.mark.parametrize("mode,g", MODES)
@pytest.mark.parametrize("grad", ["e4m3", "e5m2"])
def test_linear_gemms_follow_the_definition(mode, g, grad):
    torch.manual_seed(0)
    x = (torch.randn(64, 96) * 3).requires_grad_()
    w = (torch.randn(32, 96) * 0.02).requires_grad_()
    dy = torch.randn(64, 32) * 1e-3
    y = scaled_linear(x, w, Float8Recipe(mode, grad_dtype=grad))
    y.backward(dy)
    xn, wn, dyn = x.detach().double().numpy(), w.detach().double().numpy(), dy.double().numpy()
    gd = DTYPES[grad]
    _close(y.detach(), _ref_mm(xn, wn, E4M3, E4M3, g), xn, wn)
    _close(x.grad, _ref_mm(dyn, wn.T.copy(), gd, E4M3, g), dyn, wn.T)
    _close(w.grad, _ref_mm(dyn.T.copy(), xn.T.copy(), gd, E4M3, g), dyn.T, xn.T)
    if g != "block":  # torch's own CPU scaled_mm agrees (an implementation we did not write)
        qx, sx = quantize(x.detach(), E4M3, g)
        qw, sw = quantize(w.detach(), E4M3, g)
        kind = F.ScalingType.TensorWise if g == "tensor" else F.ScalingType.RowWise
        sx, sw = (sx.reshape(()), sw.reshape(())) if g == "tensor" else (sx, sw.T)
        ref = F.scaled_mm(qx, qw.T, sx, kind, sw, kind, output_dtype=torch.float32)
        torch.testing.assert_close(y.detach(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode,g", MODES)
def test_gradients_match_finite_differences_within_quantisation_error(mode, g):
    torch.manual_seed(1)
    x, w, c = torch.randn(32, 64), torch.randn(32, 64), torch.randn(32, 32)

    def losses(xv, wv):  # the high-precision function, float64, for a batch of inputs
        return (c.double() * (xv.double() @ wv.double().transpose(-2, -1))).sum((-2, -1))

    xq, wq = x.clone().requires_grad_(), w.clone().requires_grad_()
    (scaled_linear(xq, wq, Float8Recipe(mode)) * c).sum().backward()
    eps, grid = 1e-3, (slice(0, None, 3), slice(0, None, 7))  # a sparse grid of coordinates
    for got, wrt, ref_abs in (
        (xq.grad, "x", c.abs() @ w.abs()),
        (wq.grad, "w", c.abs().T @ x.abs()),
    ):
        t = x if wrt == "x" else w
        idx = torch.zeros_like(t, dtype=torch.bool)
        idx[grid] = True
        d = torch.zeros(int(idx.sum()), *t.shape, dtype=torch.float64)
        d.view(d.shape[0], -1)[torch.arange(d.shape[0]), idx.flatten().nonzero().flatten()] = eps
        plus = losses(t + d, w) if wrt == "x" else losses(x, t + d)
        minus = losses(t - d, w) if wrt == "x" else losses(x, t - d)
        fd = ((plus - minus) / (2 * eps)).float()
        # two e4m3 operands: relative error <= 2 * 2^-4 + 2^-8 of sum |a| |b|, plus FD noise
        tol = (2 * 2**-4 + 2**-8) * ref_abs[idx] + 1e-6
        diff = (got[idx] - fd).abs()
        assert bool((diff <= tol).all())
        assert diff.max() > 0  # the GEMMs really were quantised


def _groups_ref(x, w, dy, ends, gd, g):
    """Per-expert forward, dgrad and wgrad with the grouped definitions, float64."""
    spans = list(zip([0, *ends[:-1]], ends, strict=True))
    xn, wn, dyn = (t.double().numpy() for t in (x, w, dy))
    end = ends[-1]
    if g == "tensor":  # one scale per buffer (valid rows) and per expert weight
        xq, dq = _qdq_ref(xn[:end], E4M3, g), _qdq_ref(dyn[:end], gd, g)
        wq = np.stack([_qdq_ref(we, E4M3, g) for we in wn])
        wtq = wq.transpose(0, 2, 1)
        dxq, dxw = dq, wtq
        wg_a, wg_b = dq, xq
    else:
        xq, dq = _qdq_ref(xn[:end], E4M3, g), _qdq_ref(dyn[:end], gd, g)
        wq = np.stack([_qdq_ref(we, E4M3, g) for we in wn])
        wtq = np.stack([_qdq_ref(we.T.copy(), E4M3, g) for we in wn])
        dxq, dxw = dq, wtq
        wg_a = np.concatenate([_qdq_ref(dyn[s:e], gd, g, axis=0) for s, e in spans])
        wg_b = np.concatenate([_qdq_ref(xn[s:e], E4M3, g, axis=0) for s, e in spans])
    y = np.concatenate([xq[s:e] @ wq[i].T for i, (s, e) in enumerate(spans)])
    dx = np.concatenate([dxq[s:e] @ dxw[i].T for i, (s, e) in enumerate(spans)])
    dw = np.stack([wg_a[s:e].T @ wg_b[s:e] for s, e in spans])
    return y, dx, dw


@pytest.mark.parametrize("mode,g", MODES)
def test_grouped_gemms_follow_the_definition_and_ignore_slack_rows(mode, g):
    torch.manual_seed(2)
    ends = [32, 32, 96, 160]  # an empty expert; groups padded to 32 rows (MX needs it)
    rows = 192  # 32 slack rows past the last group hold garbage
    x = torch.randn(rows, 64) * 2
    x[160:] = float("nan")
    w = torch.randn(4, 32, 64) * 0.05
    dy = torch.randn(rows, 32) * 1e-2
    dy[160:] = float("inf")
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    offs = torch.tensor(ends, dtype=torch.int32)
    y = scaled_grouped_linear(xg, wg, offs, Float8Recipe(mode, grad_dtype="e5m2"))
    y.backward(dy)
    y_ref, dx_ref, dw_ref = _groups_ref(x, w, dy, ends, E5M2, g)
    tol = dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(y.detach()[:160].double(), torch.from_numpy(y_ref), **tol)
    torch.testing.assert_close(xg.grad[:160].double(), torch.from_numpy(dx_ref), **tol)
    torch.testing.assert_close(wg.grad.double(), torch.from_numpy(dw_ref), **tol)


def test_grouped_mxfp8_needs_rows_padded_to_blocks():
    with pytest.raises(ValueError, match="multiples of 32"):
        scaled_grouped_linear(
            torch.ones(40, 32), torch.ones(2, 32, 32), torch.tensor([8, 40]), Float8Recipe("mxfp8")
        )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["fp8_tensorwise", "fp8_rowwise", "mxfp8"])
def test_device_gemms_match_the_emulation(mode):
    """The real kernels (scaled_mm / scaled_grouped_mm) against the emulated definition: equal
    up to the order of fp32 accumulation."""
    from titan_models.components.scaled_mm import check_device_support

    dev = torch.device("cuda")
    try:
        check_device_support(Float8Recipe(mode), dev, grouped=False)
    except ValueError as e:
        pytest.skip(str(e))
    torch.manual_seed(3)
    x = torch.randn(256, 512, device=dev, dtype=torch.bfloat16)
    w = torch.randn(384, 512, device=dev, dtype=torch.bfloat16) * 0.02
    dy = torch.randn(256, 384, device=dev, dtype=torch.bfloat16)
    outs = []
    for emulate in (False, True):
        xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = scaled_linear(xe, we, Float8Recipe(mode, emulate=emulate))
        y.backward(dy)
        outs.append((y.float(), xe.grad.float(), we.grad.float()))
    for got, want in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=1e-2)
    if mode == "mxfp8":
        return
    offs = torch.tensor([64, 64, 192, 256], dtype=torch.int32, device=dev)
    we = torch.randn(4, 384, 512, device=dev, dtype=torch.bfloat16) * 0.02
    ys = [
        scaled_grouped_linear(x, we, offs, Float8Recipe(mode, emulate=emulate)).float()
        for emulate in (False, True)
    ]
    torch.testing.assert_close(ys[0], ys[1], rtol=2e-2, atol=1e-2)
