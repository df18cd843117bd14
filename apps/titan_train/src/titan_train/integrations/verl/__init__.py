"""A veRL (0.9.1) training engine over Titan: veRL's worker, losses and data; Titan's model,
sharding and checkpoints.

veRL drives training through an engine (``verl.workers.engine.BaseEngine``): it hands the
engine batches of packed sequences (a ``TensorDict`` of jagged tensors) and a loss function,
and asks for per-token log-probs, a backward, an optimizer step, checkpoints and the weights
for its rollout. ``TitanEngineWithLMHead`` implements that contract with

- the model from ``titan_models``, built on ``meta`` from the HF folder veRL names and
  filled piece by piece (``titan_train.materialize``): only the bytes each rank holds are read;
- data parallelism from ``flexshard`` through the app's ``parallelize`` (one bucket per block,
  HSDP with ``dp_replicate > 1``): gradient reduction in its backward hooks, the global-norm
  clip in ``flexshard.clip_grad_norm_``;
- checkpoints from ``torch_checkpointing`` (sharded, reshardable, atomic), plus the HF export
  veRL's ``hf_model`` content asks for;
- veRL's own pieces wherever the host defines the semantics: its loss functions, micro-batching
  (``prepare_micro_batches``), log-prob and entropy functions, optimizer factory and LR
  schedules, so the numbers mean what they mean in veRL's FSDP engine.

Importing this module registers the engine in veRL's ``EngineRegistry`` under backend
``"titan"`` (model type ``language_model``). A veRL config selects it with the actor config
class of this module (``actor_rollout_ref.actor._target_=titan_train.integrations.verl.
TitanActorConfig``, whose ``strategy`` is ``titan``) and by importing this module in every
worker: ``VERL_USE_EXTERNAL_MODULES=titan_train.integrations.verl`` (veRL imports it on
``import verl``) or ``actor_rollout_ref.model.external_lib=titan_train.integrations.verl``.

Packed sequences: veRL's no-padding batches are concatenated into one row; each sequence is a
document (``document_ids``), so attention stays inside it and positions come from veRL's
``position_ids``. ``use_remove_padding`` changes nothing here: the computation is the same.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch
import torch.distributed as dist

# veRL lives in its own environment (apps/titan_train/verl_env), not the repository's: the
# type checker of the repository cannot see it.
try:
    from verl.trainer.config import CheckpointConfig  # pyrefly: ignore[missing-import]
    from verl.utils import tensordict_utils as tu  # pyrefly: ignore[missing-import]
    from verl.utils import torch_functional as verl_F  # pyrefly: ignore[missing-import]
    from verl.workers.config import (  # pyrefly: ignore[missing-import]
        ActorConfig,
        EngineConfig,
        FSDPOptimizerConfig,
        HFModelConfig,
    )
    from verl.workers.engine.base import (  # pyrefly: ignore[missing-import]
        BaseEngine,
        BaseEngineCtx,
        EngineRegistry,
    )
    from verl.workers.engine.utils import (  # pyrefly: ignore[missing-import]
        detach_tree,
        postprocess_batch_func,
        prepare_micro_batches,
    )
except ImportError as e:  # the app itself never imports this module
    raise ImportError(
        "titan_train.integrations.verl needs verl==0.9.1, which cannot share the repository's "
        "environment (it caps transformers<5.11): build its own with "
        "apps/titan_train/verl_env/build_env.sh"
    ) from e

import titan_models
from titan_train.config import (
    CompileConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    RematConfig,
    TrainingConfig,
)
from titan_train.device import resolve_device
from titan_train.integrations.verl.support import ModeContext, lr_scheduler
from titan_train.layout import ParallelDims, build_mesh, check_plan
from titan_train.losses import autocast
from titan_train.materialize import global_state, materialize
from titan_train.model_config import ModelClass
from titan_train.parallelize import ParallelModel, parallelize

__all__ = ["TitanActorConfig", "TitanEngine", "TitanEngineConfig", "TitanEngineWithLMHead"]

logger = logging.getLogger(__name__)

VerlBatch = Any
"""veRL's batch: a ``tensordict.TensorDict`` of jagged tensors plus non-tensor settings
(tensordict comes with veRL; only veRL itself is imported here)."""

BACKEND = "titan"
"""The ``strategy`` / registry backend name that selects this engine."""

_DEVICES: tuple[Literal["auto", "cpu", "cuda"], ...] = ("auto", "cpu", "cuda")
_PRECISIONS: tuple[Literal["fp32", "bf16"], ...] = ("fp32", "bf16")
_REMAT: tuple[Literal["none", "full", "selective", "every_nth"], ...] = (
    "none",
    "full",
    "selective",
    "every_nth",
)


# veRL's configs are ``verl.base_config.BaseConfig`` dataclasses, whose frozen-field check reads
# the instance ``__dict__``: no ``slots`` here.
@dataclass(kw_only=True)
class TitanEngineConfig(EngineConfig):
    """veRL engine config of the Titan engine (veRL's shared fields plus Titan's layout)."""

    strategy: str = BACKEND
    """Registry backend; must be ``"titan"``."""
    device: str = "auto"
    """``auto`` (the accelerator of ``LOCAL_RANK`` if present, else the CPU), ``cpu``, ``cuda``."""
    dp_replicate: int = 1
    """HSDP replicas (gradients averaged across them, parameters sharded within one)."""
    dp_shard: int = -1
    """Ranks one replica's parameters are sharded over by flexshard (-1: the rest)."""
    attention_backend: str = "auto"
    """titan_models attention backend (``auto``: flex on CUDA, varlen elsewhere)."""
    mixed_precision: str = "fp32"
    """``fp32``, or ``bf16`` (bf16 compute, fp32 master weights and gradient reduction)."""
    remat: str = "none"
    """Activation rematerialisation per block: ``none``, ``full``, ``selective``, ``every_nth``."""
    compile: bool = False
    """``torch.compile`` each block."""
    entropy_from_logits_with_chunking: bool = False
    """veRL's chunked entropy (less memory for large vocabularies)."""
    entropy_from_logits_chunk_size: int = 2048
    """Tokens per chunk of the chunked entropy."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("strategy", self.strategy, (BACKEND,))
        _check_choice("device", self.device, _DEVICES)
        _check_choice("mixed_precision", self.mixed_precision, _PRECISIONS)
        _check_choice("remat", self.remat, _REMAT)
        titan_models.resolve_attention_backend(self.attention_backend, "cpu")  # registered?
        if self.dp_replicate < 1:
            raise ValueError(f"TitanEngineConfig: dp_replicate={self.dp_replicate} must be >= 1")
        if self.dp_shard < 1 and self.dp_shard != -1:
            raise ValueError(
                f"TitanEngineConfig: dp_shard={self.dp_shard} must be >= 1, or -1 (the ranks "
                "dp_replicate leaves)"
            )
        for name in ("param_offload", "optimizer_offload"):
            if getattr(self, name):
                raise ValueError(
                    f"TitanEngineConfig.{name}=True is not supported: the titan engine keeps "
                    "parameters and optimizer state on the training device"
                )


@dataclass(kw_only=True)
class TitanActorConfig(ActorConfig):
    """veRL actor config that trains with the Titan engine (``strategy="titan"``)."""

    strategy: str = BACKEND
    """Registry backend; must be ``"titan"``."""
    titan: TitanEngineConfig = field(default_factory=TitanEngineConfig)
    """The engine's config (veRL reads it as ``actor.engine``)."""
    use_remove_padding: bool = False
    """veRL's flag; the titan engine always packs sequences."""
    use_rollout_log_probs: bool = False
    """Use the rollout's log-probs as the old policy's (veRL's flag)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_choice("TitanActorConfig.strategy", self.strategy, (BACKEND,))
        self.engine = self.titan


_Choice = TypeVar("_Choice", bound=str)


def _check_choice(name: str, value: str, allowed: tuple[_Choice, ...]) -> _Choice:
    """``value`` as the one of ``allowed`` it equals; ``ValueError`` naming it otherwise."""
    for choice in allowed:
        if value == choice:
            return choice
    raise ValueError(f"TitanEngineConfig: {name}={value!r} must be one of {list(allowed)}")


def _job_config(engine_config: TitanEngineConfig, max_grad_norm: float) -> JobConfig:
    """The app's job config for the parts of a job the engine runs: layout, precision, remat,
    compile (data, schedule and checkpoints are veRL's)."""
    c = engine_config  # its choices were checked in __post_init__; narrowed here
    return JobConfig(
        model=ModelConfig(attention_backend=engine_config.attention_backend),
        parallel=ParallelConfig(
            dp_replicate=engine_config.dp_replicate, dp_shard=engine_config.dp_shard
        ),
        training=TrainingConfig(
            mixed_precision=_check_choice("mixed_precision", c.mixed_precision, _PRECISIONS),
            max_grad_norm=max_grad_norm,
            seed=engine_config.seed,
            device=_check_choice("device", c.device, _DEVICES),
        ),
        remat=RematConfig(policy=_check_choice("remat", c.remat, _REMAT)),
        compile=CompileConfig(enabled=engine_config.compile),
    )


class TitanEngine(BaseEngine):
    """veRL ``BaseEngine`` over a Titan model sharded by flexshard (see the module doc)."""

    def __init__(
        self,
        model_config: HFModelConfig,
        engine_config: TitanEngineConfig,
        optimizer_config: FSDPOptimizerConfig,
        checkpoint_config: CheckpointConfig,
    ) -> None:
        super().__init__()
        if not isinstance(engine_config, TitanEngineConfig):
            raise TypeError(
                f"engine_config must be a TitanEngineConfig, got {type(engine_config).__name__}"
            )
        if not engine_config.forward_only and not isinstance(optimizer_config, FSDPOptimizerConfig):
            raise TypeError(
                "optimizer_config must be a verl FSDPOptimizerConfig (optimizer, optimizer_impl, "
                f"lr_scheduler_type), got {type(optimizer_config).__name__}"
            )
        if getattr(model_config, "lora_rank", 0) > 0:
            raise ValueError(
                f"model_config.lora_rank={model_config.lora_rank}: LoRA is not supported"
            )
        if not dist.is_initialized():
            raise ValueError("the titan engine needs torch.distributed initialised (veRL does it)")
        self.model_config = model_config
        self.engine_config = engine_config
        self.optimizer_config = optimizer_config
        self.checkpoint_config = checkpoint_config
        self.mode = None
        clip = 0.0 if engine_config.forward_only else float(optimizer_config.clip_grad or 0.0)
        self.job = _job_config(engine_config, clip)
        self.device = resolve_device(engine_config.device)
        # Everything that can reject the model or the layout, before any allocation.
        model_cls, config = titan_models.hf_model_config(model_config.local_path)
        # titan_models types the class as type[Transformer], whose own constructor also takes
        # the blocks; every family's class is built from its config alone.
        self._model_cls = cast(ModelClass, model_cls)
        self.titan_config = dataclasses.replace(
            config, attention_backend=engine_config.attention_backend
        )
        self.dims = ParallelDims.resolve(self.job, dist.get_world_size())
        self.plan = titan_models.get_plan(self.titan_config)
        check_plan(self.job, self.dims, self.plan)
        self._entropy: Callable[[torch.Tensor], torch.Tensor] = verl_F.entropy_from_logits
        if engine_config.entropy_from_logits_with_chunking:
            chunk = engine_config.entropy_from_logits_chunk_size
            self._entropy = partial(verl_F.entropy_from_logits_with_chunking, chunk_size=chunk)
        self.pm: ParallelModel | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None
        self._saved: list[str] = []

    # --- build ------------------------------------------------------------------------

    def initialize(self) -> None:
        """Build this rank's part of the model on ``meta``, shard it, read its pieces of the HF
        checkpoint, and build the optimizer and LR schedule (veRL's factories)."""
        meshes = build_mesh(self.dims, self.device.type)
        with torch.device("meta"):
            model = self._model_cls(self.titan_config)
        self.pm = parallelize(model, self.job, self.dims, meshes, self.plan)
        materialize(
            self.pm, self.device, seed=self.engine_config.seed, hf_path=self.model_config.local_path
        )
        if self.engine_config.forward_only:
            self.optimizer = self.lr_scheduler = None
            return
        from verl.workers.config.optimizer import (  # pyrefly: ignore[missing-import]
            build_optimizer,
        )

        params = [p for p in self.pm.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, self.optimizer_config)
        self.lr_scheduler = lr_scheduler(self.optimizer, self.optimizer_config)

    @property
    def parallel_model(self) -> ParallelModel:
        """This rank's parts of the model (built by ``initialize``)."""
        if self.pm is None:
            raise RuntimeError("the titan engine is not initialised: call initialize() first")
        return self.pm

    @property
    def module(self) -> torch.nn.Module:
        """The model (this rank's shards of it)."""
        return self.parallel_model.parts[0]

    def _optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise RuntimeError(
                "the titan engine has no optimizer: it is forward_only, or initialize() was not "
                "called"
            )
        return self.optimizer

    @property
    def is_param_offload_enabled(self) -> bool:
        return False

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return False

    def train_mode(self, **kwargs: Any) -> BaseEngineCtx:
        """Context in which the model trains (zeroes gradients on exit, as veRL's engines do)."""
        return ModeContext(self, "train", **kwargs)

    def eval_mode(self, **kwargs: Any) -> BaseEngineCtx:
        """Context in which the model evaluates."""
        return ModeContext(self, "eval", **kwargs)

    # --- layout -----------------------------------------------------------------------

    def get_data_parallel_rank(self) -> int:
        return self.pm.dp_rank if self.pm is not None and self.pm.meshes else dist.get_rank()

    def get_data_parallel_size(self) -> int:
        return self.dims.dp

    def get_data_parallel_group(self) -> Any:
        # Every rank is a data-parallel rank (no tp / pp / cp in this engine).
        return dist.group.WORLD

    def is_mp_src_rank_with_outputs(self) -> bool:
        return True

    # --- step -------------------------------------------------------------------------

    def forward_backward_batch(
        self, data: VerlBatch, loss_function: Callable | None, forward_only: bool = False
    ) -> Any:
        """Per micro-batch: forward, veRL's loss, backward (gradients reduced by flexshard
        in the last micro-batch's backward only). Returns veRL's ``postprocess_batch_func``
        of the outputs (log-probs in the batch's order)."""
        tu.assign_non_tensor(data, sp_size=1)
        return_model_output = tu.get_non_tensor_data(data, key="return_model_output", default=False)
        # veRL's losses normalise by the tokens of the global batch and multiply by dp_size,
        # since the data-parallel reduction averages (flexshard averages, like FSDP).
        num_tokens = data["loss_mask"].sum().to(self.device)
        dist.all_reduce(num_tokens, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=num_tokens.item())
        tu.assign_non_tensor(data, dp_size=self.get_data_parallel_size())
        micro_batches, indices = prepare_micro_batches(
            data=data, dp_group=self.get_data_parallel_group(), same_micro_num_in_dp=True
        )
        outputs = []
        grad_ctx = torch.no_grad() if forward_only else nullcontext()
        for i, micro_batch in enumerate(micro_batches):
            pm = self.parallel_model
            if pm.sharded and not forward_only:  # accumulate locally until the last one
                for part in pm.flexshard_parts():
                    part.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with grad_ctx:
                loss, output = self.forward_step(micro_batch, loss_function, forward_only)
                if not forward_only:
                    loss.backward()
                    if not return_model_output:
                        output.pop("model_output", None)
            outputs.append(output)
        return postprocess_batch_func(output_lst=outputs, indices=indices, data=data)

    def forward_step(
        self, micro_batch: VerlBatch, loss_function: Callable | None, forward_only: bool
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        raise NotImplementedError("forward_step is the model head's (TitanEngineWithLMHead)")

    def optimizer_zero_grad(self) -> None:
        self._optimizer().zero_grad(set_to_none=True)

    def optimizer_step(self) -> float:
        """Clip to ``optimizer_config.clip_grad`` by the global norm (flexshard) and step;
        a non-finite norm skips the update (as veRL's engines do). Returns the norm."""
        import flexshard

        optimizer = self._optimizer()
        params = self.parallel_model.parameters()
        clip = self.job.training.max_grad_norm
        if clip > 0:
            norm = flexshard.clip_grad_norm_(params, clip)
        else:
            norm = flexshard.global_grad_norm(params)
        if torch.isfinite(norm):
            optimizer.step()
        else:
            logger.warning("titan engine: grad norm is %s, update skipped", norm.item())
        optimizer.zero_grad(set_to_none=True)
        return norm.item()

    def lr_scheduler_step(self) -> float:
        self.lr_scheduler.step()
        return self.lr_scheduler.get_last_lr()[0]

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        """A no-op for this engine's own device; offloading elsewhere is not supported."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        if (model or optimizer) and torch.device(device).type != self.device.type:
            raise NotImplementedError(
                f"titan engine: moving the model/optimizer to {device!r} (offload) is not "
                f"supported; they stay on {self.device}"
            )

    # --- weights for the rollout ------------------------------------------------------

    def get_per_tensor_param(
        self, **kwargs: Any
    ) -> tuple[Iterator[tuple[str, torch.Tensor]], None]:
        """Every HF tensor of the current weights, whole, under its HF name (what veRL's
        rollout loads). Each rank gathers the whole model once (flexshard's full state)."""
        state = self._full_state()
        export = titan_models.hf_export(state, self.titan_config)

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for key, pieces in export.tensors.items():
                [(_, tensor)] = pieces.local_chunks()  # whole tensors: one chunk each
                transform = export.transforms.get(key)
                yield key, transform(tensor) if transform is not None else tensor

        return tensors(), None

    def _full_state(self) -> dict[str, torch.Tensor]:
        part = self.module
        if self.parallel_model.sharded:
            import flexshard

            return flexshard.full_state_dict(part, rank0_only=False, cpu_offload=False)
        return {k: v.detach() for k, v in part.state_dict().items()}

    # --- checkpoints ------------------------------------------------------------------

    def save_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        global_step: int = 0,
        max_ckpt_to_keep: int | None = None,
        **kwargs: Any,
    ) -> None:
        """torch_checkpointing checkpoint of ``checkpoint_config.save_contents`` (``model``,
        ``optimizer``, ``extra``: LR schedule and RNG) under ``local_path``; ``hf_model``
        also writes ``local_path/huggingface``. ``max_ckpt_to_keep``: older ``local_path``
        folders this engine saved are deleted (veRL's FSDP checkpoint manager does the same)."""
        from torch_checkpointing import CheckpointManager

        if hdfs_path is not None:
            raise ValueError(f"titan engine: hdfs_path={hdfs_path!r} is not supported")
        contents = list(self.checkpoint_config.save_contents)
        with CheckpointManager(local_path, async_mode="off") as manager:
            manager.save(global_step, self._checkpoint_state(contents, global_step))
        if "hf_model" in contents:
            from titan_train.checkpointing import write_hf

            state = global_state(self.parallel_model)
            write_hf(state, self.titan_config, Path(local_path) / "huggingface")
        self._saved.append(local_path)
        if max_ckpt_to_keep and len(self._saved) > max_ckpt_to_keep:
            old, self._saved = self._saved[:-max_ckpt_to_keep], self._saved[-max_ckpt_to_keep:]
            dist.barrier()
            if dist.get_rank() == 0:
                for path in old:
                    shutil.rmtree(path, ignore_errors=True)

    def load_checkpoint(
        self,
        local_path: str,
        hdfs_path: str | None = None,
        del_local_after_load: bool = True,
        **kwargs: Any,
    ) -> None:
        """Fill the model, optimizer and extras (``checkpoint_config.load_contents``) in place
        from the newest checkpoint under ``local_path`` (any world size / layout reshards).
        The folder is kept: it is the checkpoint itself, not a download."""
        from torch_checkpointing import CheckpointManager

        if hdfs_path is not None:
            raise ValueError(f"titan engine: hdfs_path={hdfs_path!r} is not supported")
        contents = list(self.checkpoint_config.load_contents)
        state = self._checkpoint_state(contents, 0)
        with CheckpointManager(local_path, read_only=True) as manager:
            manager.load(state)

    def _checkpoint_state(self, contents: list[str], step: int) -> dict[str, Any]:
        import flexshard
        from titan_train.checkpointing import ModelState, OptimizerState, TrainState
        from torch_checkpointing import PerRank

        # HSDP replicas hold the same shards, so their pieces are saved per rank (as the app does).
        per_rank = self.dims.dp_replicate > 1
        state: dict[str, Any] = {}
        pm = self.parallel_model
        if "model" in contents:
            model = ModelState(pm)
            state["model"] = PerRank(model) if per_rank else model
        if "optimizer" in contents and self.optimizer is not None:
            if pm.sharded:  # moments with their parameter's layout: reshardable
                optim = OptimizerState(pm.parts[0], self.optimizer)
            else:
                flexshard.init_optim_state(self.optimizer)  # a fresh one: targets to load into
                optim = self.optimizer
            state["optim"] = PerRank(optim) if per_rank else optim
        if "extra" in contents:
            if self.lr_scheduler is not None:
                state["lr"] = self.lr_scheduler
            train = TrainState(self.device)
            train.step = step
            state["train"] = PerRank(train)
        return state


@EngineRegistry.register(model_type="language_model", backend=BACKEND, device=["cuda", "cpu"])
class TitanEngineWithLMHead(TitanEngine):
    """The Titan engine for causal language models: per-token log-probs (and entropy) of the
    next token, as veRL's FSDP engine computes them."""

    def forward_step(
        self, micro_batch: VerlBatch, loss_function: Callable | None, forward_only: bool
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """One micro-batch: the packed forward, veRL's ``model_output`` (nested log-probs,
        entropy), and the loss ``loss_function`` makes of it."""
        micro_batch = micro_batch.to(self.device)
        for key in ("distillation_use_topk", "use_fused_kernels"):
            if tu.get_non_tensor_data(micro_batch, key=key, default=False):
                raise ValueError(f"titan engine: {key}=True is not supported")
        if len(micro_batch.get("multi_modal_inputs", [])):
            raise ValueError("titan engine: multi_modal_inputs are not supported (text only)")
        input_ids, position_ids = micro_batch["input_ids"], micro_batch["position_ids"]
        if position_ids.dim() == 3:
            raise ValueError("titan engine: 3-D (M-RoPE) position_ids are not supported")
        offsets = input_ids.offsets()
        lengths = offsets.diff()
        tokens = input_ids.values().unsqueeze(0)  # (1, T): every sequence, one after another
        positions = position_ids.values().unsqueeze(0).to(torch.long)
        rows = torch.arange(len(lengths), device=tokens.device)
        document_ids = torch.repeat_interleave(rows, lengths).unsqueeze(0)
        with autocast(self.job, self.device):
            logits = self.module(tokens, positions=positions, document_ids=document_ids)
            model_output = self._model_output(logits[0], tokens[0], lengths, offsets, micro_batch)
            if loss_function is not None:
                loss, metrics = loss_function(
                    model_output=model_output,
                    data=micro_batch,
                    dp_group=self.get_data_parallel_group(),
                )
            else:
                if not forward_only:
                    raise ValueError("titan engine: training needs a loss_function")
                loss, metrics = torch.ones((), device=self.device), {}
        output = {
            "model_output": detach_tree(model_output),
            "loss": loss.detach().item(),
            "metrics": metrics,
        }
        return loss, output

    def _model_output(
        self,
        logits_TV: torch.Tensor,
        tokens_T: torch.Tensor,
        lengths: torch.Tensor,
        offsets: torch.Tensor,
        micro_batch: VerlBatch,
    ) -> dict[str, torch.Tensor]:
        temperature = micro_batch["temperature"]
        if isinstance(temperature, torch.Tensor):  # one per sequence
            per_token = torch.repeat_interleave(temperature.to(torch.float32), lengths)
            logits_TV = logits_TV / per_token.clamp(min=1e-8).to(logits_TV.dtype).unsqueeze(-1)
        elif float(temperature) != 1.0:
            logits_TV = logits_TV / float(temperature)
        entropy = tu.get_non_tensor_data(micro_batch, key="calculate_entropy", default=False)
        sum_pi2 = tu.get_non_tensor_data(micro_batch, key="calculate_sum_pi_squared", default=False)
        # The target of each token is the next one; the last token of a sequence gets the
        # next sequence's first, which veRL's loss masks (its loss_mask is rolled the same way).
        labels_T = torch.roll(tokens_T, shifts=-1, dims=0)
        out = {
            "log_probs": verl_F.logprobs_from_logits(
                logits=logits_TV, labels=labels_T, inplace_backward=not (entropy or sum_pi2)
            )
        }
        if entropy:
            out["entropy"] = self._entropy(logits_TV)
        if sum_pi2:
            out["sum_pi_squared"] = verl_F.calculate_sum_pi_squared_from_logits(logits_TV)
        return {k: torch.nested.nested_tensor_from_jagged(v, offsets) for k, v in out.items()}
