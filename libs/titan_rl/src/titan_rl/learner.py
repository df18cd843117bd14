"""The GRPO policy update, on one process or on a data-parallel group of ranks.

``GRPOLearner.step(batch)`` is the one implementation of a GRPO step: ``GRPOTrainer`` calls it
in one process, the trainer actors of ``titan_rl.actors`` call it on every rank of their mesh.

Data parallelism (``DataParallel`` hook, injected): every rank gets the whole batch (the
advantages are group statistics), computes log-probs and the loss on its contiguous share of
each minibatch's rows, and scales its loss so that the *average* of the ranks' gradients (the
reduction the hook performs, as flexshard and DDP do by default) equals the gradient one
process computes on the whole minibatch: for ``token_mean`` by ``world * tokens_here /
tokens``, for the per-sequence aggregations by ``world * rows_here / rows``. Gradient
reduction and global-norm clipping are the hook's (titan_rl shards nothing itself).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn

from .batch_invariant import batch_invariant
from .diagnostics import logprob_diagnostics, reward_diagnostics
from .logprobs import sequence_logprobs
from .loss_registry import get_loss
from .losses import group_advantages
from .packing import packed_sequence_logprobs
from .rollout import RolloutBatch


@runtime_checkable
class DataParallel(Protocol):
    """How a trainer rank's model is made data parallel (picklable: it travels to the ranks).

    The app passes flexshard (``parallelize`` = ``flexshard.shard(model, group)``,
    ``reduce_gradients`` a no-op since flexshard reduces in its backward hooks,
    ``clip_grad_norm_`` = ``flexshard.clip_grad_norm_``, ``state_dict`` =
    ``flexshard.sharded_state_dict``); ``AllReduceGradients`` is a dependency-free fallback.
    """

    def parallelize(self, model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        """Make ``model`` (the same weights on every rank) data parallel over ``group``;
        after backward (and ``reduce_gradients``) its gradients are the group's average."""
        ...

    def reduce_gradients(self, model: nn.Module) -> None:
        """Called after each backward (a no-op where the parallel runtime reduces itself)."""
        ...

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip the global gradient norm of the whole model to ``max_norm``; returns the norm."""
        ...

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model's weights by name: tensors (whole) or objects with ``global_shape``,
        ``dtype`` and ``local_chunks() -> [(offset, chunk)]`` (the pieces this rank holds)."""
        ...


class AllReduceGradients:
    """The plain data-parallel hook: whole model on every rank, gradients all-reduced (mean)."""

    def __init__(self) -> None:
        self._group: dist.ProcessGroup | None = None

    def parallelize(self, model: nn.Module, group: dist.ProcessGroup) -> nn.Module:
        self._group = group
        with torch.no_grad():
            for t in model.state_dict().values():  # start from identical weights
                dist.broadcast(t, dist.get_global_rank(group, 0), group=group)
        return model

    def reduce_gradients(self, model: nn.Module) -> None:
        world = dist.get_world_size(self._group)
        for p in model.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad, group=self._group)
                p.grad.div_(world)

    def clip_grad_norm_(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def state_dict(self, model: nn.Module) -> dict[str, Any]:
        return {k: v.detach() for k, v in model.state_dict().items()}


class GRPOLearner:
    """The GRPO policy update of ``model`` (one process, or one rank of a ``DataParallel``
    group: ``group`` and ``data_parallel`` given, ``model`` already parallelized)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: Any,
        *,
        ref_model: nn.Module | None = None,
        group: dist.ProcessGroup | None = None,
        data_parallel: DataParallel | None = None,
        version: int = 0,
    ) -> None:
        """``config``: a ``GRPOConfig`` (shared, not copied)."""
        if (group is None) != (data_parallel is None):
            raise ValueError("GRPOLearner: group and data_parallel come together (both or none)")
        if config.loss.kl_coef > 0 and ref_model is None:
            raise ValueError(f"LossConfig.kl_coef={config.loss.kl_coef} needs a ref_model")
        self.model, self.optimizer, self.config, self.ref_model = (
            model,
            optimizer,
            config,
            ref_model,
        )
        self.group, self.data_parallel = group, data_parallel
        self.world = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.version = version
        """Optimizer steps taken = version of the weights this learner holds."""

    def step(self, batch: RolloutBatch, *, max_lag: int | None = None) -> dict[str, Any]:
        """One GRPO step on ``batch`` (``num_minibatches`` optimizer steps, one version).

        Refuses a batch from the future or, with ``max_lag``, older than that many versions.
        The PPO ratio is taken against the trainer's log-probs at the start of the step (the
        proximal policy); the generator's enter through the correction.
        """
        c = self.config
        staleness = self.version - batch.weight_version
        if staleness < 0 or (max_lag is not None and staleness > max_lag):
            raise RuntimeError(
                f"batch of weight version {batch.weight_version} at trainer version "
                f"{self.version}: lag {staleness} outside [0, {max_lag}]"
            )
        gen = batch.generation
        rows = len(batch.prompts)
        gen.validate(rows)
        if rows % c.num_minibatches:
            raise ValueError(
                f"GRPOConfig.num_minibatches={c.num_minibatches} must divide the {rows} rows"
            )
        size = rows // c.num_minibatches
        if size < self.world:
            raise ValueError(
                f"{size} rows per minibatch cannot be shared by {self.world} data-parallel "
                "ranks (each needs >= 1): raise num_prompts or lower num_minibatches"
            )
        device = _device(self.model)
        policy_loss = get_loss(c.loss.name)
        normalize = (
            c.normalize_std if policy_loss.normalize_std is None else policy_loss.normalize_std
        )
        advantages = group_advantages(batch.rewards, c.group_size, normalize_std=normalize)
        advantages, mask = advantages.to(device), gen.mask.to(device)
        rollout = gen.logprobs.to(device)
        self.model.train()
        # This rank's rows of every minibatch (all rows in one process).
        shares = [self._share(slice(s, s + size)) for s in range(0, rows, size)]
        old = ref = None
        if c.num_minibatches > 1:  # the proximal policy must be fixed before the first update
            old = self._fixed_logprobs(self.model, batch, shares)
        if self.ref_model is not None:
            ref = self._fixed_logprobs(self.ref_model, batch, shares)

        losses, norms, clipped, kls, first_logprobs = [], [], [], [], None
        for i, mb in enumerate(shares):
            logprobs = self._logprobs(self.model, batch, mb, grad=True)
            if first_logprobs is None:
                first_logprobs = logprobs.detach()
            out = policy_loss.fn(
                logprobs,
                logprobs.detach() if old is None else old[i],
                advantages[mb],
                mask[mb],
                c.loss,
                rollout_logprobs=rollout[mb],
                ref_logprobs=None if ref is None else ref[i],
            )
            scale = self._loss_scale(gen.mask, mb, size, i)
            (out.loss if scale is None else out.loss * scale).backward()
            if self.data_parallel is not None:
                self.data_parallel.reduce_gradients(self.model)
            norms.append(self._optimizer_step())
            stats = (float(out.loss.detach()), out.clip_fraction, out.kl)
            if scale is not None:  # the minibatch's loss and its token means, over the group
                stats = self._reduce_stats(stats, gen.mask[mb], scale)
            losses.append(stats[0])
            clipped.append(stats[1])
            kls.append(stats[2])
        self.version += 1
        # Trainer vs generator on the sampled tokens, before this step's updates.
        diag_rows = slice(shares[0].start, shares[-1].stop) if old is not None else shares[0]
        trainer_lp = torch.cat(old) if old is not None else first_logprobs
        assert trainer_lp is not None  # the first minibatch's, at least
        diag_mask = gen.mask[diag_rows]
        if old is not None and self.world > 1:  # this rank's rows of every minibatch
            diag_mask = torch.cat([gen.mask[mb] for mb in shares])
            rollout_lp = torch.cat([gen.logprobs[mb] for mb in shares])
        else:
            rollout_lp = gen.logprobs[diag_rows]
        return {
            "step": batch.step,
            "batch_weight_version": batch.weight_version,
            "trainer_version": self.version - 1,
            "staleness": staleness,
            "loss": sum(losses) / len(losses),
            "grad_norm": max(norms),
            "clip_fraction": sum(clipped) / len(clipped),
            "kl_ref": sum(kls) / len(kls),
            **self._logprob_diagnostics(trainer_lp, rollout_lp, diag_mask),
            **reward_diagnostics(batch.rewards, gen.lengths),
            "reward_statuses": batch.status_counts(),
        }

    def _fixed_logprobs(
        self, model, batch: RolloutBatch, shares: list[slice]
    ) -> list[torch.Tensor]:
        """No-grad log-probs of this rank's rows of each minibatch (one forward over the
        whole batch in one process, as the minibatches are all of its rows)."""
        if self.world == 1:
            full = self._logprobs(model, batch, slice(None), grad=False)
            return [full[mb] for mb in shares]
        return [self._logprobs(model, batch, mb, grad=False) for mb in shares]

    def _share(self, mb: slice) -> slice:
        if self.world == 1:
            return mb
        part = torch.arange(mb.start, mb.stop).tensor_split(self.world)[self.rank]
        return slice(int(part[0]), int(part[-1]) + 1)

    def _loss_scale(self, mask: torch.Tensor, mine: slice, size: int, i: int) -> float | None:
        """The factor making the group's mean gradient the one-process gradient (None: 1)."""
        if self.world == 1:
            return None
        if self.config.loss.aggregation == "token_mean":
            start = i * size
            total = float(mask[start : start + size].sum().clamp(min=1))
            return self.world * float(mask[mine].sum()) / total
        return self.world * (mine.stop - mine.start) / size

    def _reduce_stats(
        self, stats: tuple[float, float, float], mask: torch.Tensor, scale: float
    ) -> tuple[float, float, float]:
        n = float(mask.sum())
        t = torch.tensor([stats[0] * scale / self.world, stats[1] * n, stats[2] * n, n])
        dist.all_reduce(t, group=self.group)
        count = max(float(t[3]), 1.0)
        return float(t[0]), float(t[1]) / count, float(t[2]) / count

    def _logprob_diagnostics(
        self, trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor
    ) -> dict[str, float]:
        if self.world == 1:
            return logprob_diagnostics(trainer.cpu(), rollout.cpu(), mask.cpu())
        # The group's diagnostics from per-rank sums (same definitions as logprob_diagnostics).
        m = mask.bool().cpu()
        log_r = (trainer.detach().cpu() - rollout.cpu()).double()[m]
        w = log_r.exp()
        sums = torch.tensor(
            [(w - 1.0 - log_r).sum(), w.sum(), (w * w).sum(), float(m.sum())], dtype=torch.float64
        )
        peak = torch.tensor([float(log_r.abs().max()) if log_r.numel() else 0.0])
        dist.all_reduce(sums, group=self.group)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=self.group)
        n = float(sums[3])
        if n == 0:
            return {"kl_generator_trainer": 0.0, "max_abs_logprob_diff": 0.0, "ess": 1.0}
        return {
            "kl_generator_trainer": float(sums[0]) / n,
            "max_abs_logprob_diff": float(peak[0]),
            "ess": float(sums[1] ** 2 / (n * sums[2])),
        }

    def _logprobs(self, model, batch: RolloutBatch, rows: slice, *, grad: bool) -> torch.Tensor:
        mode = batch_invariant() if self.config.batch_invariant else nullcontext()
        gen = batch.generation
        images = batch.model_images(rows)
        with mode, torch.set_grad_enabled(grad):
            if self.config.pack_sequences and images is None:
                return packed_sequence_logprobs(
                    model,
                    batch.prompts[rows],
                    gen.tokens[rows],
                    gen.mask[rows],
                    temperature=self.config.sampling.temperature,
                    max_row_tokens=self.config.max_row_tokens,
                )
            lp = sequence_logprobs(
                model,
                batch.prompts[rows],
                gen.tokens[rows],
                gen.mask[rows],
                temperature=self.config.sampling.temperature,
                images=images,
            )
        return lp

    def _optimizer_step(self) -> float:
        max_norm = self.config.max_grad_norm
        if self.data_parallel is not None:
            norm = self.data_parallel.clip_grad_norm_(self.model, max_norm or float("inf"))
        else:
            params = [p for p in self.model.parameters() if p.grad is not None]
            if max_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)


def _device(model: nn.Module) -> torch.device:
    weight = next(iter(model.parameters()), None)
    return torch.device("cpu") if weight is None else weight.device
