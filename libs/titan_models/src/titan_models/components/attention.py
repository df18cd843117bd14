"""Grouped-query attention through ``scaled_dot_product_attention``, with optional QK-norm.

Shapes: B batch, S queries, L keys, D model dim, H query heads, K kv heads, E head dim.
The head counts are read off the projections at run time (``view(B, S, -1, E)``), so a
tensor-parallel plan that shards the projections by heads needs no change here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kv_cache import KVCache, LayerKVCache
from .norm import RMSNorm
from .rope import apply_rotary


class Attention(nn.Module):
    """Causal GQA: ``wq``/``wk``/``wv`` → [QK-norm] → RoPE → SDPA → ``wo``."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        qk_norm_eps: float | None = None,
        qk_norm_offset: float = 0.0,
        softmax_scale: float | None = None,
        output_gate: bool = False,
    ) -> None:
        """``qk_norm_eps``: RMSNorm q and k per head (Qwen3) with this eps; ``None`` for none.
        ``qk_norm_offset``: 1 for zero-centred QK-norm weights (Qwen3.5). ``output_gate``: ``wq``
        also yields a per-channel sigmoid gate of the attention output (Qwen3.5's gated
        attention; each head's rows are its query then its gate)."""
        super().__init__()
        self.head_dim = head_dim
        self.softmax_scale = softmax_scale
        self.output_gate = output_gate
        q_rows = num_heads * head_dim * (2 if output_gate else 1)
        self.wq = nn.Linear(dim, q_rows, bias=False)
        self.wk = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, num_kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(num_heads * head_dim, dim, bias=False)
        norm = None if qk_norm_eps is None else {"eps": qk_norm_eps, "offset": qk_norm_offset}
        self.q_norm = RMSNorm(head_dim, **norm) if norm is not None else None
        self.k_norm = RMSNorm(head_dim, **norm) if norm is not None else None

    def forward(
        self,
        x_BSD: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        kv_cache: LayerKVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``mask``: ``None`` for plain causal attention, else a boolean ``(B, 1, S, L)`` (it
        already holds the document boundaries; ``document_ids`` is for recurrent mixers)."""
        B, S, _ = x_BSD.shape
        gate_BSHE = None
        if self.output_gate:
            q_BSHE, gate_BSHE = self.wq(x_BSD).view(B, S, -1, 2 * self.head_dim).chunk(2, dim=-1)
        else:
            q_BSHE = self.wq(x_BSD).view(B, S, -1, self.head_dim)
        k_BSKE = self.wk(x_BSD).view(B, S, -1, self.head_dim)
        v_BSKE = self.wv(x_BSD).view(B, S, -1, self.head_dim)
        if self.q_norm is not None:
            q_BSHE, k_BSKE = self.q_norm(q_BSHE), self.k_norm(k_BSKE)
        q_BSHE, k_BSKE = apply_rotary(q_BSHE, rope), apply_rotary(k_BSKE, rope)

        q_BHSE = q_BSHE.transpose(1, 2)
        if kv_cache is not None:
            k_BKLE, v_BKLE = kv_cache.update(k_BSKE, v_BSKE)
        else:
            k_BKLE, v_BKLE = k_BSKE.transpose(1, 2), v_BSKE.transpose(1, 2)
        o_BHSE = F.scaled_dot_product_attention(
            q_BHSE,
            k_BKLE,
            v_BKLE,
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.softmax_scale,
            enable_gqa=q_BHSE.shape[1] != k_BKLE.shape[1],
        )
        o_BSHE = o_BHSE.transpose(1, 2)
        if gate_BSHE is not None:
            o_BSHE = o_BSHE * torch.sigmoid(gate_BSHE)
        return self.wo(o_BSHE.reshape(B, S, -1))

    def init_weights(self, *, std: float, out_std: float, generator: torch.Generator) -> None:
        """Normal ``std`` for q/k/v, ``out_std`` for the residual output ``wo``; norms to one."""
        for linear in (self.wq, self.wk, self.wv):
            nn.init.normal_(linear.weight, std=std, generator=generator)
        nn.init.normal_(self.wo.weight, std=out_std, generator=generator)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.init_weights()


def positions_from_document_ids(document_ids_BS: torch.Tensor) -> torch.Tensor:
    """Each token's position inside its document: 0 at every change of document id."""
    B, S = document_ids_BS.shape
    index_BS = torch.arange(S, device=document_ids_BS.device).expand(B, S)
    is_start_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    is_start_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    start_BS = torch.where(is_start_BS, index_BS, 0).cummax(dim=1).values
    return index_BS - start_BS


def attention_inputs(
    batch_size: int,
    seq_len: int,
    device: torch.device,
    *,
    positions: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    kv_cache: KVCache | None,
    input_lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Positions ``(B, S)`` and the attention mask (``None`` = plain causal) for one forward.

    - ``kv_cache``: tokens go to the rows' next free slots; a query sees the slots up to its own
      (``input_lengths``: the real tokens of each row, for the cache's recurrent layers).
    - ``document_ids``: causal within a document, nothing across (packed training sequences);
      positions restart at 0 in every document unless given.
    - neither: plain causal attention over ``0 .. S-1`` (SDPA's ``is_causal`` fast path).
    """
    if kv_cache is not None:
        if document_ids is not None:
            raise ValueError("document_ids cannot be combined with kv_cache")
        if kv_cache.batch_size != batch_size:
            raise ValueError(
                f"kv_cache has batch_size={kv_cache.batch_size}, the input has {batch_size}"
            )
        slots_BS = kv_cache.begin(seq_len, input_lengths)
        mask = kv_cache.attention_mask(slots_BS)
        return (slots_BS if positions is None else positions), mask
    if document_ids is not None:
        if document_ids.shape != (batch_size, seq_len):
            raise ValueError(
                f"document_ids must have shape {(batch_size, seq_len)}, "
                f"got {tuple(document_ids.shape)}"
            )
        same_doc_BSS = document_ids[:, :, None] == document_ids[:, None, :]
        causal_SS = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        mask = (same_doc_BSS & causal_SS).unsqueeze(1)
        if positions is None:
            positions = positions_from_document_ids(document_ids)
        return positions, mask
    if positions is None:
        positions = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
    return positions, None
