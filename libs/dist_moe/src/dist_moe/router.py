"""Token-choice top-k router: softmax, sigmoid or sqrt-softplus scores, group-limited selection,
bias balancing; or hash routing (experts looked up from the token id).

Shapes: ``T`` tokens, ``E`` experts, ``K`` = top_k, ``G`` groups, ``D`` model dim.

Selection and weights (per token):

1. ``logits = x @ W_gate^T`` (``+ b_gate`` with ``gate_bias``, gpt-oss); ``scores`` =
   ``softmax(logits)``, ``sigmoid(logits)`` or ``sqrt(softplus(logits))`` (DeepSeek-V4), fp32.
2. ``choice = scores + expert_bias`` (the bias exists only for selection; it is zero unless
   aux-loss-free balancing updates it).
3. Group-limited (``num_groups > 1``): a group's score is the sum of its top-2 ``choice``
   values ("top2_sum", DeepSeek-V3) or its max ("max", DeepSeek-V2); keep the
   ``topk_groups`` best groups and mask the others' experts to -inf.
4. ``indices`` = the ``K`` best ``choice`` values. Ties go to the lower index, on every
   device: selection is a stable descending sort, not ``torch.topk``.
5. ``weights = scores[indices]`` (unbiased); if ``norm_topk_prob``: divided by their sum
   (+1e-20); then multiplied by ``route_scale``.

Hash routing (``hash_vocab_size > 0``, DeepSeek-V4's first layers after Roller et al. 2021):
steps 2-4 are replaced by a fixed lookup, ``indices = expert_table[token_id]`` (a ``(V, K)``
buffer saved with the model, never trained); the weights are step 5 on the learned scores.

Qwen3-MoE is ``score_func="softmax", norm_topk_prob=<config>``; gpt-oss (softmax over the
top-k logits) is ``score_func="softmax", norm_topk_prob=True, gate_bias=True``; DeepSeek-V3 is
``score_func="sigmoid", num_groups=n_group, topk_groups=topk_group, group_score="top2_sum",
norm_topk_prob=True, route_scale=routed_scaling_factor, bias_update_rate=gamma``.

Aux-loss-free balancing (DeepSeek-V3, Wang et al. 2024), the documented rule: during training
every forward adds its per-expert token counts to ``tokens_per_expert``; once per optimizer
step ``update_bias()`` (all-reducing the counts over ``group`` first, so every replica makes
the same update) applies

    delta_e = rate * sign(mean(c) - c_e);  expert_bias += delta - mean(delta)

and resets the counts. Overloaded experts become less attractive, underloaded more; centring
keeps the mean bias at zero. The rule depends only on the sign of each expert's deviation,
so it is the same whether counts come from one micro-batch or many (gradient accumulation),
and a forward recomputed by activation checkpointing (which counts twice in every expert)
does not change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dist_moe.kernels import expert_histogram

__all__ = [
    "ExpertLoad",
    "RouterConfig",
    "RouterOutput",
    "TopKRouter",
    "expert_load",
    "hash_expert_table",
    "sequence_parallel_balance",
    "update_expert_biases",
]


@dataclass(kw_only=True, slots=True)
class RouterConfig:
    """Token-choice top-k routing."""

    num_experts: int
    """Routed experts E."""
    top_k: int
    """Experts per token K."""
    score_func: Literal["softmax", "sigmoid", "sqrtsoftplus"] = "softmax"
    """How logits become scores (softmax over all E experts, an independent sigmoid, or
    ``sqrt(softplus(logit))``)."""
    num_groups: int = 1
    """Expert groups G for group-limited routing (1: no group limit). Must divide E."""
    topk_groups: int = 1
    """Groups kept per token when num_groups > 1."""
    group_score: Literal["top2_sum", "max"] = "top2_sum"
    """Score of a group: sum of its two best expert scores (DeepSeek-V3), or its best."""
    norm_topk_prob: bool = False
    """Renormalise the K selected weights to sum to 1."""
    route_scale: float = 1.0
    """Multiply the final weights by this (DeepSeek-V3's routed_scaling_factor)."""
    bias_update_rate: float = 0.0
    """Aux-loss-free balancing step size gamma (0 disables the bias update)."""
    seq_aux_loss_coef: float = 0.0
    """Weight alpha of the sequence-wise balance loss (0: not computed)."""
    force_balance: bool = False
    """Benchmarking: ignore the scores and deal assignments round-robin (perfect balance)."""
    logits_dtype: torch.dtype | None = torch.float32
    """Dtype of the gate matmul (None: the input's dtype, as HF Qwen3-MoE does)."""
    gate_bias: bool = False
    """A learned bias on the gate logits (``router.gate.bias``, gpt-oss)."""
    hash_vocab_size: int = 0
    """> 0: hash routing over token ids in ``[0, hash_vocab_size)``: the experts of a token are
    row ``token_id`` of the ``expert_table`` buffer (``forward(..., token_ids=)``); 0: top-k."""

    def __post_init__(self) -> None:
        def positive_int(name: str, v: object) -> None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"RouterConfig.{name} must be an int >= 1, got {v!r}")

        positive_int("num_experts", self.num_experts)
        positive_int("top_k", self.top_k)
        positive_int("num_groups", self.num_groups)
        positive_int("topk_groups", self.topk_groups)
        if self.top_k > self.num_experts:
            raise ValueError(
                f"RouterConfig.top_k={self.top_k} must be <= num_experts={self.num_experts}"
            )
        if self.score_func not in ("softmax", "sigmoid", "sqrtsoftplus"):
            raise ValueError(
                "RouterConfig.score_func must be 'softmax', 'sigmoid' or 'sqrtsoftplus', "
                f"got {self.score_func!r}"
            )
        v = self.hash_vocab_size
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"RouterConfig.hash_vocab_size must be an int >= 0, got {v!r}")
        if v and (self.num_groups > 1 or self.force_balance or self.bias_update_rate > 0):
            raise ValueError(
                "RouterConfig.hash_vocab_size > 0 (hash routing) selects experts by table: "
                "num_groups must be 1, force_balance False and bias_update_rate 0, got "
                f"num_groups={self.num_groups}, force_balance={self.force_balance}, "
                f"bias_update_rate={self.bias_update_rate}"
            )
        if self.num_experts % self.num_groups:
            raise ValueError(
                f"RouterConfig.num_experts={self.num_experts} must be divisible by "
                f"num_groups={self.num_groups}"
            )
        if self.topk_groups > self.num_groups:
            raise ValueError(
                f"RouterConfig.topk_groups={self.topk_groups} must be <= "
                f"num_groups={self.num_groups}"
            )
        if self.num_groups > 1:
            reachable = self.topk_groups * (self.num_experts // self.num_groups)
            if self.top_k > reachable:
                raise ValueError(
                    f"RouterConfig.top_k={self.top_k} must be <= topk_groups * experts per "
                    f"group = {reachable}"
                )
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(
                f"RouterConfig.group_score must be 'top2_sum' or 'max', got {self.group_score!r}"
            )
        if not self.route_scale > 0:
            raise ValueError(f"RouterConfig.route_scale must be > 0, got {self.route_scale!r}")
        if not self.bias_update_rate >= 0:
            raise ValueError(
                f"RouterConfig.bias_update_rate must be >= 0, got {self.bias_update_rate!r}"
            )
        if not self.seq_aux_loss_coef >= 0:
            raise ValueError(
                f"RouterConfig.seq_aux_loss_coef must be >= 0, got {self.seq_aux_loss_coef!r}"
            )
        if self.logits_dtype is not None and not (
            isinstance(self.logits_dtype, torch.dtype) and self.logits_dtype.is_floating_point
        ):
            raise ValueError(
                f"RouterConfig.logits_dtype must be None or a floating dtype, "
                f"got {self.logits_dtype!r}"
            )


@dataclass(slots=True)
class RouterOutput:
    """What one routing decision produced."""

    weights: torch.Tensor
    """(T, K) combine weights, in the input's dtype; differentiable w.r.t. the gate."""
    indices: torch.Tensor
    """(T, K) int64 expert ids."""
    counts: torch.Tensor
    """(E,) int64 assignments per expert in this forward."""
    aux_loss: torch.Tensor | None
    """Scalar sequence-wise balance loss (already times alpha), or None when disabled."""
    logits: torch.Tensor | None = None
    """(T, E) gate logits ``x @ W_gate^T`` in ``logits_dtype`` (what HF models report as
    ``router_logits``)."""


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """Expert load over the tokens counted since the last reset (host values)."""

    tokens_per_expert: tuple[int, ...]
    max_over_mean: float
    """max_e c_e / mean_e c_e: 1.0 is perfect balance (nan before any token)."""
    min_over_mean: float


class TopKRouter(nn.Module):
    """Token-choice top-k router; see the module docstring for the exact formulas."""

    def __init__(self, dim: int, config: RouterConfig) -> None:
        super().__init__()
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise ValueError(f"TopKRouter: dim must be an int >= 1, got {dim!r}")
        self.config = config
        self.dim = dim
        self.gate = nn.Linear(dim, config.num_experts, bias=config.gate_bias)
        # Selection-only bias (DeepSeek-V3's e_score_correction_bias); saved in checkpoints.
        self.register_buffer("expert_bias", torch.zeros(config.num_experts, dtype=torch.float32))
        # Counts since the last bias update / reset; training-only bookkeeping.
        self.register_buffer(
            "tokens_per_expert",
            torch.zeros(config.num_experts, dtype=torch.int64),
            persistent=False,
        )
        if config.hash_vocab_size:
            # Hash routing: token id -> its K experts; saved, never trained. Built on the meta
            # device it stays empty until the model's init or checkpoint fills it.
            table = torch.zeros(config.hash_vocab_size, config.top_k, dtype=torch.int64)
            if not table.is_meta:
                table = hash_expert_table(config.hash_vocab_size, config.num_experts, config.top_k)
            self.register_buffer("expert_table", table)
        # The ranks each sequence's tokens are split over (context parallelism); see
        # ``sequence_parallel_balance``. None: every rank holds whole sequences.
        self.sequence_group: dist.ProcessGroup | None = None

    @property
    def is_hash(self) -> bool:
        """Whether experts are looked up from token ids (hash routing)."""
        return self.config.hash_vocab_size > 0

    def reset_parameters(self, std: float = 0.02) -> None:
        nn.init.trunc_normal_(self.gate.weight, std=std, a=-3 * std, b=3 * std)
        if self.gate.bias is not None:
            nn.init.zeros_(self.gate.bias)

    # ---- selection ------------------------------------------------------------------

    def logits(self, x_TD: torch.Tensor) -> torch.Tensor:
        """(T, E) gate logits in ``logits_dtype`` (the input's dtype when None)."""
        cfg = self.config
        w, b = self.gate.weight, self.gate.bias
        if cfg.logits_dtype is not None:
            dtype = cfg.logits_dtype
            return F.linear(x_TD.to(dtype), w.to(dtype), None if b is None else b.to(dtype))
        return F.linear(x_TD, w, b)

    def scores(self, x_TD: torch.Tensor) -> torch.Tensor:
        """(T, E) fp32 routing scores."""
        return self._scores(self.logits(x_TD))

    def _scores(self, logits_TE: torch.Tensor) -> torch.Tensor:
        if self.config.score_func == "softmax":
            return torch.softmax(logits_TE, dim=-1, dtype=torch.float32)
        if self.config.score_func == "sqrtsoftplus":
            return F.softplus(logits_TE.float()).sqrt()
        return torch.sigmoid(logits_TE.float())

    def select(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """(T, K) expert ids chosen from ``scores + expert_bias`` (group-limited if configured)."""
        cfg = self.config
        t = scores_TE.shape[0]
        if cfg.force_balance:
            n = torch.arange(t * cfg.top_k, device=scores_TE.device)
            return (n % cfg.num_experts).reshape(t, cfg.top_k)
        choice_TE = scores_TE.detach() + self.expert_bias
        if cfg.num_groups > 1:
            g, per = cfg.num_groups, cfg.num_experts // cfg.num_groups
            choice_TGP = choice_TE.reshape(t, g, per)
            if cfg.group_score == "top2_sum":
                best = torch.sort(choice_TGP, dim=-1, descending=True, stable=True).values
                group_TG = best[..., : min(2, per)].sum(-1)
            else:
                group_TG = choice_TGP.amax(-1)
            keep_groups = _stable_topk(group_TG, cfg.topk_groups)
            keep_TG = torch.zeros_like(group_TG, dtype=torch.bool).scatter_(1, keep_groups, True)
            keep_TE = keep_TG[:, :, None].expand(t, g, per).reshape(t, cfg.num_experts)
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        return _stable_topk(choice_TE, cfg.top_k)

    def forward(
        self,
        x_TD: torch.Tensor,
        *,
        seq_len: int | None = None,
        token_ids: torch.Tensor | None = None,
    ) -> RouterOutput:
        """Route (T, D) tokens. ``seq_len`` splits T into sequences for the aux loss;
        ``token_ids`` (T,) are required by hash routing (and ignored otherwise)."""
        cfg = self.config
        logits_TE = self.logits(x_TD)
        scores_TE = self._scores(logits_TE)
        if self.is_hash:
            indices_TK = self.hash_select(token_ids, x_TD.shape[0])
        else:
            indices_TK = self.select(scores_TE)
        weights_TK = scores_TE.gather(1, indices_TK)
        if cfg.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdim=True) + 1e-20)
        if cfg.route_scale != 1.0:
            weights_TK = weights_TK * cfg.route_scale
        counts = expert_histogram(indices_TK, cfg.num_experts)
        if self.training:
            with torch.no_grad():
                self.tokens_per_expert.add_(counts)
        aux = None
        if cfg.seq_aux_loss_coef > 0 and self.training:
            aux = self._sequence_aux_loss(scores_TE, indices_TK, seq_len)
        return RouterOutput(
            weights=weights_TK.to(x_TD.dtype),
            indices=indices_TK,
            counts=counts,
            aux_loss=aux,
            logits=logits_TE,
        )

    def hash_select(self, token_ids: torch.Tensor | None, num_tokens: int) -> torch.Tensor:
        """(T, K) experts of hash routing: rows ``token_ids`` of ``expert_table``."""
        if token_ids is None:
            raise ValueError(
                "hash routing (RouterConfig.hash_vocab_size > 0) needs token_ids: pass the (T,) "
                "token ids of the routed tokens"
            )
        if token_ids.is_floating_point() or tuple(token_ids.shape) != (num_tokens,):
            raise ValueError(
                f"token_ids must be an integer tensor of shape ({num_tokens},), got "
                f"{token_ids.dtype} {tuple(token_ids.shape)}"
            )
        return self.expert_table[token_ids].long()

    def _sequence_aux_loss(
        self, scores_TE: torch.Tensor, indices_TK: torch.Tensor, seq_len: int | None
    ) -> torch.Tensor:
        # DeepSeek-V3 eq. (17)-(20), averaged over sequences:
        #   f_e = E / (K * S) * #{t : e in topk(t)},  P_e = mean_t s'_{t,e},
        #   s' = scores normalised over experts;  L = alpha * sum_e f_e * P_e.
        cfg = self.config
        t, e, k = scores_TE.shape[0], cfg.num_experts, cfg.top_k
        s = seq_len or t
        if t % s:
            raise ValueError(f"seq_len={seq_len} must divide the number of tokens {t}")
        b = t // s
        norm_BSE = (scores_TE / (scores_TE.sum(-1, keepdim=True) + 1e-20)).reshape(b, s, e)
        hits_BE = torch.zeros(b, e, device=scores_TE.device, dtype=torch.float32)
        hits_BE.scatter_add_(
            1, indices_TK.reshape(b, s * k), torch.ones(b, s * k, device=scores_TE.device)
        )
        group = self.sequence_group
        if group is not None and dist.get_world_size(group) > 1:
            # Each rank holds s of the row's s * n tokens: f_e counts the whole row, and
            # P_e stays this rank's mean, so the ranks' losses average to the row's loss and
            # each rank's gradient is the row loss's gradient for its tokens, times n (the
            # data-parallel gradient average over the n ranks takes it back).
            dist.all_reduce(hits_BE, group=group)
            s = s * dist.get_world_size(group)
        f_BE = hits_BE * (e / (k * s))
        p_BE = norm_BSE.mean(1)
        return cfg.seq_aux_loss_coef * (f_BE * p_BE).sum(-1).mean()

    # ---- balancing -------------------------------------------------------------------

    @torch.no_grad()
    def update_bias(self, group: dist.ProcessGroup | None = None) -> None:
        """Apply the aux-loss-free bias rule once (per optimizer step) and reset the counts.

        The counts are first summed over ``group`` (default: the default process group when
        one is initialised), the ranks holding replicas of this router, so every replica
        applies the same update. With ``bias_update_rate == 0`` only the reset happens.
        """
        rate = self.config.bias_update_rate
        if rate > 0:
            counts = self.tokens_per_expert.to(torch.float32)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(counts, group=group)
            delta = rate * torch.sign(counts.mean() - counts)  # all zero when nothing counted
            self.expert_bias.add_(delta - delta.mean())
        self.tokens_per_expert.zero_()

    def load(self) -> ExpertLoad:
        """Load statistics of the tokens counted since the last ``update_bias``/reset."""
        return expert_load(self.tokens_per_expert)

    @torch.no_grad()
    def reset_load(self) -> None:
        self.tokens_per_expert.zero_()


def expert_load(counts: torch.Tensor) -> ExpertLoad:
    """``ExpertLoad`` of an (E,) count vector (reads it back to the host)."""
    c = [int(v) for v in counts.tolist()]
    mean = sum(c) / len(c)
    if mean == 0:
        return ExpertLoad(tokens_per_expert=tuple(c), max_over_mean=float("nan"), min_over_mean=0.0)
    return ExpertLoad(
        tokens_per_expert=tuple(c), max_over_mean=max(c) / mean, min_over_mean=min(c) / mean
    )


def hash_expert_table(
    vocab_size: int, num_experts: int, top_k: int, *, generator: torch.Generator | None = None
) -> torch.Tensor:
    """A ``(vocab_size, top_k)`` int64 hash-routing table: each token id's ``top_k`` distinct
    experts, uniformly at random (seed 0 unless ``generator`` is given), every expert receiving
    about the same number of ids."""
    if generator is None:
        generator = torch.Generator().manual_seed(0)
    device = generator.device
    keys = torch.rand(vocab_size, num_experts, generator=generator, device=device)
    return keys.argsort(dim=-1)[:, :top_k].contiguous()


def _stable_topk(values: torch.Tensor, k: int) -> torch.Tensor:
    # Stable descending sort: equal values keep ascending index order on every backend.
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def update_expert_biases(module: nn.Module, group: dist.ProcessGroup | None = None) -> int:
    """Call ``update_bias(group)`` on every ``TopKRouter`` inside ``module``; returns how many.

    Call it once per optimizer step (after ``optimizer.step()``), not per micro-batch.
    """
    n = 0
    for m in module.modules():
        if isinstance(m, TopKRouter):
            m.update_bias(group)
            n += 1
    return n


def sequence_parallel_balance(module: nn.Module, group: dist.ProcessGroup | None) -> int:
    """Tell every ``TopKRouter`` in ``module`` that each sequence's tokens are split over
    ``group`` (context parallelism), so the sequence-wise balance loss counts expert hits over
    whole sequences (one all-reduce of a ``(B, E)`` count per MoE layer and step). ``None``
    undoes it. Returns the number of routers set."""
    routers = [m for m in module.modules() if isinstance(m, TopKRouter)]
    for router in routers:
        router.sequence_group = group
    return len(routers)
