"""Every attention backend equals a dense reference written here from the definitions: forward
and gradients, packed documents (empty and 1-token ones included), sliding windows (shorter
and longer than the documents), sinks and softcap in any combination. Bad input is refused."""

from __future__ import annotations

import random

import pytest
import torch

import titan_models
from titan_models import AttentionMetadata, attend
from titan_models.components import backends, flex, varlen
from titan_models.components.dense_attention import dense_attention

TOL = 1e-5  # fp32 backends vs an fp64 reference


def reference(q, k, v, document_ids, *, window, sinks, scale, softcap, bidirectional=False):
    """Attention from the definitions, in float64: query i sees key j iff j <= i (unless
    bidirectional), both in one document, and i - j < window; a sink is one more logit per
    head with a zero value."""
    B, S, H, _ = q.shape
    group = H // k.shape[2]
    q, k, v = (
        q.double(),
        k.double().repeat_interleave(group, 2),
        v.double().repeat_interleave(group, 2),
    )
    scores = torch.einsum("bqhe,bkhe->bhqk", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i, j = torch.arange(S)[:, None], torch.arange(S)[None, :]
    visible = (document_ids[:, :, None] == document_ids[:, None, :]) & ((j <= i) | bidirectional)
    if window is not None:
        visible = visible & (i - j < window)
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, H, 1, 1).expand(B, H, S, 1)
        probs = torch.cat([scores, sink], -1).softmax(-1)[..., :S]
    else:
        probs = scores.softmax(-1)
    return torch.einsum("bhqk,bkhv->bqhv", probs, v)


def _lengths(rng: random.Random, S: int, max_docs: int) -> list[int]:
    """Random document lengths summing to S, with an empty and a 1-token document mixed in."""
    cuts = sorted(rng.randint(1, S - 1) for _ in range(rng.randint(0, max_docs - 1)))
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, S], strict=True)]
    lengths[lengths.index(max(lengths))] -= 1
    lengths.insert(rng.randint(0, len(lengths)), 1)
    lengths.insert(rng.randint(0, len(lengths)), 0)
    return lengths


# Every combination of window (none, shorter and longer than some documents), sinks and
# softcap over random packed rows; then a 1-token window, a window wider than the row and
# single-document rows.
GRID = [(w, sinks, cap) for cap in (None, 2.0) for sinks in (False, True) for w in (None, 3, 7)]
EXTRA = [(1, True, None, [[40], [40]]), (64, False, 2.0, None), (None, False, None, [[40], [40]])]
SEEDS = range(len(GRID) + len(EXTRA))


def _case(seed: int):
    rng = random.Random(seed)
    B, S, H, K, E = 2, 40, 4, 2, 8
    V = rng.choice([8, 6])  # a narrower value width, as MLA's
    lengths = [_lengths(rng, S, 6) for _ in range(B)]
    if seed < len(GRID):
        window, with_sinks, softcap = GRID[seed]
    else:
        window, with_sinks, softcap, rows = EXTRA[seed - len(GRID)]
        lengths = rows or lengths
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, S, H, E, generator=g), torch.randn(B, S, K, E, generator=g)
    v = torch.randn(B, S, K, V, generator=g)
    options = dict(
        window=window,
        sinks=torch.randn(H, generator=g) if with_sinks else None,
        scale=rng.choice([None, 0.3]),
        softcap=softcap,
    )
    return lengths, (q, k, v), options


def _check(
    backend: str, seed: int, *, grads: bool, device: str = "cpu", bidirectional: bool = False
) -> None:
    lengths, (q, k, v), options = _case(seed)
    if bidirectional:
        options["window"] = None
    meta = AttentionMetadata.from_lengths(
        lengths, q.shape[1], device, backend=backend, bidirectional=bidirectional
    )
    ids = torch.stack(
        [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths]
    )
    scale = options["scale"] or q.shape[-1] ** -0.5
    cpu_inputs = [q, k, v] + ([options["sinks"]] if options["sinks"] is not None else [])
    inputs = [t.to(device, copy=True).requires_grad_(grads) for t in cpu_inputs]
    sinks = inputs[3] if len(inputs) == 4 else None
    out = attend(*inputs[:3], meta, **{**options, "sinks": sinks})
    ref_inputs = [t.double().requires_grad_(grads) for t in cpu_inputs]
    ref_sinks = ref_inputs[3] if sinks is not None else None
    ref = reference(
        *ref_inputs[:3],
        ids,
        **{**options, "sinks": ref_sinks, "scale": scale},
        bidirectional=bidirectional,
    )
    assert out.shape == ref.shape
    assert (out.double().cpu() - ref).abs().max().item() <= TOL, (lengths, options)
    if grads:
        weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
        (out * weight.to(device)).sum().backward()
        (ref * weight.double()).sum().backward()
        for name, a, b in zip("qkvs", inputs, ref_inputs, strict=False):
            diff = (a.grad.double().cpu() - b.grad).abs().max().item()
            assert diff <= TOL, (name, diff, lengths, options)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_backend_forward_and_gradients_equal_the_reference(backend, seed):
    _check(backend, seed, grads=True)


# Bidirectional (an encoder's images as documents): sinks and softcap on and off, packed rows
# and single-document rows (seed 14).
BIDIRECTIONAL_SEEDS = [0, 3, 6, 9, 14]


@pytest.mark.parametrize("seed", BIDIRECTIONAL_SEEDS)
@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_bidirectional_documents_equal_the_reference(backend, seed):
    _check(backend, seed, grads=True, bidirectional=True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", BIDIRECTIONAL_SEEDS[:2])
def test_flex_bidirectional_forward_equals_the_reference(eager_flex, seed):
    with torch.no_grad():
        _check("flex", seed, grads=False, bidirectional=True)


def test_bidirectional_attention_refuses_a_window():
    meta = AttentionMetadata.from_lengths([[3, 5]], 8, "cpu", bidirectional=True)
    q = torch.randn(1, 8, 2, 4)
    with pytest.raises(ValueError, match="bidirectional attention"):
        attend(q, q, q, meta, window=2)


@pytest.fixture
def eager_flex(monkeypatch):
    """FlexAttention un-compiled (same semantics; compiling it on CPU takes minutes)."""
    monkeypatch.setattr(flex, "_EAGER_FLEX", True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", SEEDS)
def test_flex_forward_equals_the_reference(eager_flex, seed):
    with torch.no_grad():
        _check("flex", seed, grads=False)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("seed", [0, 4, 9])
def test_varlen_without_flash_on_an_accelerator_runs_flex(eager_flex, monkeypatch, seed):
    # The CPU posing as an accelerator (FlexAttention with a backward): no host tile plan.
    monkeypatch.setattr(flex, "_NO_FLEX_BACKWARD", ())
    monkeypatch.setattr(varlen, "_plan", None)  # a host plan would fail here
    with torch.no_grad():
        _check("varlen", seed, grads=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("seed", range(4))
def test_flex_and_varlen_forward_and_gradients_on_cuda(seed):
    _check("flex", seed, grads=True, device="cuda")  # compiled FlexAttention
    _check("varlen", seed, grads=True, device="cuda")  # fp32: the tile path on CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_varlen_uses_torch_flash_varlen_in_bf16_on_cuda():
    lengths, (q, k, v), options = _case(1)
    meta = AttentionMetadata.from_lengths(lengths, q.shape[1], "cuda", backend="varlen")
    dense = AttentionMetadata.from_lengths(lengths, q.shape[1], "cuda", backend="sdpa")
    q, k, v = (t.cuda().bfloat16() for t in (q, k, v))
    kw = {"window": options["window"]}
    diff = (attend(q, k, v, meta, **kw) - attend(q, k, v, dense, **kw)).abs().max().item()
    assert diff <= 2e-2  # bf16 rounding


def test_varlen_tiles_a_long_document_into_band_pieces():
    # 3 documents (50, 130, 12 tokens) and window 16: the long ones become a 16-token causal
    # piece and 16-query band pieces (3 and 8); the short one stays whole.
    from titan_models.components import varlen

    meta = AttentionMetadata.from_lengths([[50, 130, 12]], 192, "cpu", backend="varlen")
    plan = varlen._plan(meta, 16)
    band = [g for g in plan.groups if g.band]
    assert len(band) == 1 and band[0].q_index.shape == (3 + 8, 16)
    causal_rows = sum(g.q_index.shape[0] for g in plan.groups if not g.band)
    assert causal_rows == 3
    assert sorted(plan.inverse.tolist()) == list(range(192))


def test_flex_backward_on_cpu_names_the_backends_to_use(eager_flex):
    meta = AttentionMetadata.causal(1, 8, "cpu", backend="flex")
    q = torch.randn(1, 8, 2, 4, requires_grad=True)
    with pytest.raises(ValueError, match="'flex' cannot run backward on cpu.*'varlen'.*'sdpa'"):
        attend(q, q, q, meta)


def test_backends_are_registered_and_auto_resolves_by_device():
    assert {"sdpa", "flex", "varlen"} <= set(titan_models.attention_backends())
    resolve = backends.resolve_attention_backend
    assert resolve("auto", "cpu") == "varlen"
    assert resolve("auto", "cuda") == "flex"


def test_a_registered_backend_is_used_by_the_model():
    calls = []

    def spy(q, k, v, meta, prepared, *, window, sinks, scale, softcap):
        calls.append(prepared)
        mask = meta.dense_mask(window)
        return dense_attention(q, k, v, mask, sinks=sinks, scale=scale, softcap=softcap)

    titan_models.register_attention_backend("spy", spy, prepare=lambda meta, window: window)
    try:
        cls, config = titan_models.get_model(
            "llama3", "debug", attention_backend="spy", sliding_window=4, sliding_window_layers=(1,)
        )
        cls(config)(torch.randint(0, 100, (1, 8)))
    finally:
        backends._BACKENDS.pop("spy")
    assert calls == [None, 4, None, None]  # one prepared structure per window, per layer


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m, q: attend(q, q, q, m, window=0), "window=0 must be an int >= 1"),
        (lambda m, q: attend(q, q, q, m, softcap=0.0), "softcap=0.0 must be > 0"),
        (lambda m, q: attend(q, q, q, m, sinks=torch.zeros(3)), r"sinks must have shape \(2,\)"),
        (lambda m, q: attend(q, q, q, m, backend="dense"), "backend='dense' is not a registered"),
    ],
)
def test_bad_layer_options_are_refused(call, match):
    meta = AttentionMetadata.causal(1, 8, "cpu")
    with pytest.raises(ValueError, match=match):
        call(meta, torch.randn(1, 8, 2, 4))


def test_bad_documents_are_refused():
    with pytest.raises(ValueError, match="non-decreasing along each row.*row 1 goes from 2 to 1"):
        AttentionMetadata.from_document_ids(torch.tensor([[0, 0, 1, 1], [0, 2, 1, 1]]))
    with pytest.raises(ValueError, match="lengths of row 0 sum to 7, not seq_len=8"):
        AttentionMetadata.from_lengths([[3, 4]], 8, "cpu")
    with pytest.raises(TypeError, match="integer tensor"):
        AttentionMetadata.from_document_ids(torch.zeros(1, 4))
    cls, config = titan_models.get_model("llama3", "debug")
    with pytest.raises(ValueError, match="document_ids must be non-decreasing"):
        cls(config)(torch.zeros(1, 4, dtype=torch.long), document_ids=torch.tensor([[1, 0, 0, 0]]))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"sliding_window": 0}, "sliding_window must be an int >= 1"),
        ({"sliding_window": -4}, "sliding_window must be an int >= 1"),
        ({"sliding_window_layers": (1,)}, "sliding_window_layers=.* needs a sliding_window"),
        ({"sliding_window": 8, "sliding_window_layers": (9,)}, r"\[9\]: layer indices lie in"),
        ({"attention_backend": "dense"}, "attention_backend='dense' is not a registered.*'varlen'"),
    ],
)
def test_bad_attention_config_names_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        titan_models.get_model("llama3", "debug", **override)


def test_cu_seqlens_are_built_without_reading_the_device():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Reads(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func._schema.name in ("aten::_local_scalar_dense", "aten::nonzero"):
                self.seen.append(func._schema.name)
            return func(*args, **(kwargs or {}))

    meta = AttentionMetadata.from_document_ids(torch.tensor([[0, 0, 1, 1, 1, 2], [3] * 6]))
    with Reads() as reads:
        cu = meta.cu_seqlens
    assert reads.seen == [] and cu.shape == (13,)


def test_cu_seqlens_are_the_document_boundaries_of_the_flattened_batch():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 4, 4]])
    meta = AttentionMetadata.from_document_ids(ids)
    # a static B·S + 1 entries: the boundaries, then empty documents at the end
    assert meta.cu_seqlens.tolist() == [0, 2, 5, 6, 10, 12, 12, 12, 12, 12, 12, 12, 12]
    assert meta.cu_seqlens.dtype == torch.int32 and meta.max_seqlen == 4
    assert meta.positions.tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 0, 1]]
    with_empty = AttentionMetadata.from_lengths([[2, 0, 4]], 6, "cpu")
    assert with_empty.cu_seqlens.tolist() == [0, 2, 2, 6]
    assert AttentionMetadata.causal(2, 6, "cpu").cu_seqlens.tolist() == [0, 6, 12]
