"""Token mixers built on the gated delta rule: Gated DeltaNet (Qwen3.5's linear-attention layers)
and Kimi Delta Attention (Kimi Linear's KDA layers).

Both run ``x → wq, wk, wv → short conv + SiLU → L2-normalised q, k → gated delta rule →
gated RMSNorm → wo``; they differ in the decay (one per head from ``wa`` for Gated DeltaNet, one
per key channel from the low-rank ``wf_a → wf_b`` for KDA) and the output gate (``wz`` with SiLU,
the low-rank ``wg_a → wg_b`` with a sigmoid). Head counts are read off the projections at run
time, so a tensor-parallel plan that shards them by heads (and the per-head vectors and conv
filters with them) needs no change here.

With a ``LayerRecurrentState`` (decoding) the layer starts from the cached conv inputs and
delta-rule state and writes back the ones after this step: one token is a recurrent step,
several (a prefill) one chunked pass. Tokens past a row's ``input_lengths`` leave both unchanged.

Shapes: B batch, S sequence, D model dim, Hk key heads, Hv value heads, K key head dim,
V value head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention_metadata import AttentionMetadata
from ..init import Constant, Init, InverseSoftplusLogUniform, LogUniform, Normal, prefixed
from ..kv_cache import LayerRecurrentState, StateSpec
from ..norm import GatedRMSNorm
from .context_parallel import sharded_delta_rule, sharded_short_convs
from .delta_rule import chunk_delta_rule, document_segments, recurrent_delta_rule
from .short_conv import ShortConvolution


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x²) + eps)`` over the last dim, in fp32 (as the reference kernels)."""
    x32 = x.float()
    return x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)


class DeltaRuleAttention(nn.Module):
    """The body both mixers share; subclasses add ``decays`` and ``output_gate``."""

    def __init__(
        self,
        *,
        dim: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel_size: int,
        norm_eps: float,
        norm_activation: str,
        chunk_size: int,
        backend: str,
    ) -> None:
        super().__init__()
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.chunk_size, self.backend = chunk_size, backend
        self.wq = nn.Linear(dim, num_key_heads * key_head_dim, bias=False)
        self.wk = nn.Linear(dim, num_key_heads * key_head_dim, bias=False)
        self.wv = nn.Linear(dim, num_value_heads * value_head_dim, bias=False)
        self.conv_q = ShortConvolution(num_key_heads * key_head_dim, conv_kernel_size)
        self.conv_k = ShortConvolution(num_key_heads * key_head_dim, conv_kernel_size)
        self.conv_v = ShortConvolution(num_value_heads * value_head_dim, conv_kernel_size)
        self.norm = GatedRMSNorm(value_head_dim, eps=norm_eps, activation=norm_activation)
        self.wo = nn.Linear(num_value_heads * value_head_dim, dim, bias=False)

    def decays(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log decays ``g <= 0`` (fp32, ``(B, S, Hv)`` or ``(B, S, Hv, K)``) and write strengths
        ``beta`` ``(B, S, Hv)``."""
        raise NotImplementedError

    def output_gate(self, x_BSD: torch.Tensor) -> torch.Tensor:
        """The gate of the output norm, ``(B, S, Hv·V)``."""
        raise NotImplementedError

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        meta: AttentionMetadata | None = None,
        kv_cache: LayerRecurrentState | None = None,
    ) -> torch.Tensor:
        """``rope`` is unused (positions enter through the recurrence); the packed documents
        of ``meta`` (its ``starts``) restart the state at every document boundary. On a
        context-parallel shard (``meta.context_parallel``) the conv windows and the state
        cross the shard edges (``linear_attention.context_parallel``)."""
        B, S, _ = x_BSD.shape
        shard = meta.context_parallel if meta is not None else None
        # A document's start index is constant over it and changes at every boundary: it
        # serves as the document id of the chunked form (no host sync). On a
        # context-parallel shard the starts are global (``context_parallel``).
        document_ids = meta.starts if shard is None and meta is not None else None
        if kv_cache is not None and document_ids is not None:
            raise ValueError(
                "document_ids cannot be combined with a KV cache in a model with "
                "linear-attention layers (their recurrent state is one per row); prefill "
                "one document per row"
            )
        K, V = self.key_head_dim, self.value_head_dim
        lengths_B = kv_cache.step_lengths() if kv_cache is not None else None
        conv_states = kv_cache.states[:3] if kv_cache is not None else (None, None, None)
        segments_BS = document_segments(document_ids) if document_ids is not None else None

        def conv(module: ShortConvolution, x_BSC: torch.Tensor, state) -> torch.Tensor:
            return module(x_BSC, segments_BS=segments_BS, state_BCW=state, lengths_B=lengths_B)

        convs = (self.conv_q, self.conv_k, self.conv_v)
        inputs = (self.wq(x_BSD), self.wk(x_BSD), self.wv(x_BSD))
        if shard is not None:  # each chunk's window reaches into the chunk before it
            q_BSC, k_BSC, v_BSC = sharded_short_convs(shard, convs, inputs)
        else:
            q_BSC, k_BSC, v_BSC = (
                conv(m, x, state) for m, x, state in zip(convs, inputs, conv_states, strict=True)
            )
        q_BSHK, k_BSHK = q_BSC.view(B, S, -1, K), k_BSC.view(B, S, -1, K)
        v_BSHV = v_BSC.view(B, S, -1, V)
        q_BSHK, k_BSHK = l2_normalize(q_BSHK), l2_normalize(k_BSHK)
        group = v_BSHV.shape[2] // q_BSHK.shape[2]  # value heads per key head
        if group > 1:
            q_BSHK = q_BSHK.repeat_interleave(group, dim=2)
            k_BSHK = k_BSHK.repeat_interleave(group, dim=2)
        g, beta_BSH = self.decays(x_BSD)
        if lengths_B is not None:  # padding of ragged prompts: no decay, no write
            real_BS = torch.arange(S, device=x_BSD.device) < lengths_B[:, None]
            beta_BSH = beta_BSH * real_BS[..., None]
            g = g * (real_BS[..., None, None] if g.dim() == 4 else real_BS[..., None])

        args = (q_BSHK, k_BSHK, v_BSHV, g, beta_BSH)
        if shard is not None:  # the state passes along the chain of chunks
            o_BSHV = sharded_delta_rule(
                shard, *args, scale=K**-0.5, chunk_size=self.chunk_size, backend=self.backend
            )
        elif kv_cache is None:
            o_BSHV, _ = chunk_delta_rule(
                *args,
                scale=K**-0.5,
                chunk_size=self.chunk_size,
                document_ids=document_ids,
                backend=self.backend,
            )
        else:
            state = kv_cache.states[3]
            if S == 1:
                o_BSHV, new_state = recurrent_delta_rule(*args, scale=K**-0.5, state=state)
            else:
                o_BSHV, new_state = chunk_delta_rule(
                    *args,
                    scale=K**-0.5,
                    chunk_size=self.chunk_size,
                    initial_state=state,
                    output_final_state=True,
                    backend=self.backend,
                )
            assert new_state is not None  # both kernels return it here
            state.copy_(new_state)
        gate_BSHV = self.output_gate(x_BSD).view(B, S, -1, V)
        o_BSHV = self.norm(o_BSHV.to(x_BSD.dtype), gate_BSHV)
        return self.wo(o_BSHV.reshape(B, S, -1))

    def recurrent_state_specs(self) -> list[StateSpec]:
        """What a KV cache holds for this layer per row: the three conv inputs ``(C, W - 1)``
        and the delta-rule state ``(Hv, K, V)`` in fp32."""
        convs = [
            ((m.weight.shape[0], m.kernel_size - 1), None)
            for m in (self.conv_q, self.conv_k, self.conv_v)
        ]
        heads = self.wv.weight.shape[0] // self.value_head_dim
        return [*convs, ((heads, self.key_head_dim, self.value_head_dim), torch.float32)]

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """N(0, std²) for the input projections, N(0, out_std²) for ``wo``; conv filters as
        ``nn.Conv1d``; output norm to one. Subclasses add their gates."""
        inits: dict[str, Init] = {f"{n}.weight": Normal(std) for n in ("wq", "wk", "wv")}
        inits["wo.weight"] = Normal(out_std)
        for name in ("conv_q", "conv_k", "conv_v", "norm"):
            inits |= prefixed(name, getattr(self, name).param_init())
        return inits


class GatedDeltaNet(DeltaRuleAttention):
    """Gated DeltaNet as in Qwen3.5 / Qwen3-Next: one decay per value head,
    ``g = -exp(A_log) · softplus(wa x + dt_bias)``, ``beta = sigmoid(wb x)``, output gate
    ``silu(wz x)``. Every ``Hv / Hk`` consecutive value heads share one query/key head."""

    def __init__(
        self,
        *,
        dim: int,
        num_key_heads: int,
        num_value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel_size: int,
        norm_eps: float,
        chunk_size: int = 64,
        backend: str = "torch",
    ) -> None:
        if num_value_heads % num_key_heads:
            raise ValueError(
                f"GatedDeltaNet num_value_heads={num_value_heads} must be a multiple of "
                f"num_key_heads={num_key_heads}"
            )
        super().__init__(
            dim=dim,
            num_key_heads=num_key_heads,
            num_value_heads=num_value_heads,
            key_head_dim=key_head_dim,
            value_head_dim=value_head_dim,
            conv_kernel_size=conv_kernel_size,
            norm_eps=norm_eps,
            norm_activation="silu",
            chunk_size=chunk_size,
            backend=backend,
        )
        self.wz = nn.Linear(dim, num_value_heads * value_head_dim, bias=False)
        self.wb = nn.Linear(dim, num_value_heads, bias=False)
        self.wa = nn.Linear(dim, num_value_heads, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_value_heads))
        self.A_log = nn.Parameter(torch.empty(num_value_heads))

    def decays(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a_BSH = self.wa(x_BSD).float() + self.dt_bias.float()
        g_BSH = -self.A_log.float().exp() * F.softplus(a_BSH)
        return g_BSH, torch.sigmoid(self.wb(x_BSD))

    def output_gate(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.wz(x_BSD)

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """As the base, plus N(0, std²) for ``wz``, ``wb``, ``wa``; ``dt_bias`` one and
        ``A_log = log U(0.01, 16)`` (HF Qwen3.5's init: decay rates spread over two decades)."""
        inits = super().param_init(std=std, out_std=out_std)
        inits |= {f"{n}.weight": Normal(std) for n in ("wz", "wb", "wa")}
        return inits | {"dt_bias": Constant(1.0), "A_log": LogUniform(0.01, 16.0)}


class KimiDeltaAttention(DeltaRuleAttention):
    """Kimi Delta Attention (Kimi Linear): one decay per key channel,
    ``g = -exp(A_log[head]) · softplus(wf_b wf_a x + dt_bias)``, ``beta = sigmoid(wb x)``,
    output gate ``sigmoid(wg_b wg_a x)``; as many query/key heads as value heads."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        head_dim: int,
        conv_kernel_size: int,
        norm_eps: float,
        chunk_size: int = 64,
        backend: str = "torch",
    ) -> None:
        super().__init__(
            dim=dim,
            num_key_heads=num_heads,
            num_value_heads=num_heads,
            key_head_dim=head_dim,
            value_head_dim=head_dim,
            conv_kernel_size=conv_kernel_size,
            norm_eps=norm_eps,
            norm_activation="sigmoid",
            chunk_size=chunk_size,
            backend=backend,
        )
        self.wf_a = nn.Linear(dim, head_dim, bias=False)
        self.wf_b = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(num_heads * head_dim))
        self.A_log = nn.Parameter(torch.empty(num_heads))
        self.wb = nn.Linear(dim, num_heads, bias=False)
        self.wg_a = nn.Linear(dim, head_dim, bias=False)
        self.wg_b = nn.Linear(head_dim, num_heads * head_dim, bias=False)

    def decays(self, x_BSD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, S, _ = x_BSD.shape
        f_BSHK = (self.wf_b(self.wf_a(x_BSD)).float() + self.dt_bias.float()).view(
            B, S, -1, self.key_head_dim
        )
        g_BSHK = -self.A_log.float().exp()[:, None] * F.softplus(f_BSHK)
        return g_BSHK, torch.sigmoid(self.wb(x_BSD))

    def output_gate(self, x_BSD: torch.Tensor) -> torch.Tensor:
        return self.wg_b(self.wg_a(x_BSD))

    def param_init(self, *, std: float, out_std: float) -> dict[str, Init]:
        """As the base, plus N(0, std²) for the gate projections; FLA's KDA init (as HF Kimi
        Linear): ``A_log = log U(1, 16)``, ``dt_bias`` the inverse softplus of
        ``exp(U(log 1e-3, log 1e-1))``, so initial decay rates span 1e-3 to 1e-1."""
        inits = super().param_init(std=std, out_std=out_std)
        inits |= {f"{n}.weight": Normal(std) for n in ("wf_a", "wf_b", "wb", "wg_a", "wg_b")}
        return inits | {
            "A_log": LogUniform(1.0, 16.0),
            "dt_bias": InverseSoftplusLogUniform(1e-3, 1e-1, floor=1e-4),
        }
