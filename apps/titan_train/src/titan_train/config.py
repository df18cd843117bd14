"""Typed configuration of a training job: every field a recipe sets or the CLI overrides."""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from titan_train.config_runtime import CompileConfig, MoEConfig, ProfilingConfig
from titan_train.fault_tolerance_config import FaultToleranceConfig, validate_fault_tolerance


@dataclass(kw_only=True, slots=True)
class ModelConfig:
    """Which model to build (a titan_models family and flavour)."""

    family: str = "llama3"
    """Model family registered in titan_models (e.g. llama3, qwen3)."""
    flavor: str = "debug"
    """Flavour of the family (e.g. debug, 8B)."""
    vocab_size: int | None = None
    """Override of the flavour's vocabulary size; None keeps the flavour's (the app sets it
    from the tokenizer for debug models)."""
    num_mtp_modules: int = -1
    """Multi-token-prediction modules (DeepSeek-V3); -1 keeps the flavour's."""
    config: tuple[str, ...] = ()
    """Fields of the family's model config, ``"field=value"`` (nested ones dotted), e.g.
    ``max_seq_len=16384 rope.theta=1e6 num_layers=2 dim=128``. Values are JSON (``null``,
    ``true``, ``[0, 2]``) or plain strings; each is checked against the field's type and the
    config class's own validation."""
    overrides: tuple[str, ...] = ()
    """Component overrides, ``"module-glob=replacement"`` (see titan_train.components), e.g.
    ``output=chunked_cross_entropy``."""
    attention_backend: str = "auto"
    """titan_models attention backend: auto (flex on CUDA, varlen elsewhere; context_parallel
    under parallel.cp > 1), flex, varlen, sdpa (dense mask: reference and short sequences), or
    context_parallel (needs parallel.cp > 1)."""


@dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Degrees of each parallel dimension; their product is the world size."""

    dp_replicate: int = 1
    """Data-parallel replicas (gradients all-reduced across them)."""
    dp_shard: int = -1
    """Data-parallel shards (flexshard); -1 takes whatever the other degrees leave."""
    tp: int = 1
    """Tensor-parallel degree."""
    pp: int = 1
    """Pipeline-parallel degree."""
    ep: int = 1
    """Expert-parallel degree (MoE models), carved out of the dp_shard x cp x tp ranks (under
    tp each tensor-parallel rank dispatches its slice of the tokens)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over this many ranks (head-tail chunks);
    training.seq_len must be divisible by 2 * cp."""
    cp_algorithm: Literal["ring", "allgather"] = "ring"
    """Context-parallel attention: ring (K/V passed round the ranks, memory O(S / cp)) or
    allgather (K/V gathered whole: fewer, larger messages)."""
    cp_tile_kernel: Literal["torch", "flex", "sdpa"] = "sdpa"
    """What computes a context-parallel attention tile (one call returning its log-sum-exp):
    sdpa (flash-attention ops, fused on every device without a compile; the default), flex
    (FlexAttention with a block mask per tile, compiled on accelerators: skips masked blocks)
    or torch (plain ops, the reference). The fused kernels take whole chunks (17 tiles per
    layer per rank at 128K CP 8)."""
    cp_tile_scores: int = 1 << 22
    """The torch tile kernel computes scores in tiles of at most this many elements
    (batch x heads x queries x keys; fp32): larger tiles mean fewer kernels and more
    temporary memory."""
    pp_schedule: str = "1f1b"
    """titan_pipeline schedule name (gpipe, 1f1b, interleaved_1f1b, zb_h1, zbv, dualpipev)."""
    pp_microbatches: int = 4
    """Microbatches per step when pp > 1."""


@dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Optimizer and its hyper-parameters."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw, or flexshard's distributed muon (AdamW for non-matrix parameters)."""
    lr: float = 3e-3
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    momentum: float = 0.95
    """Muon momentum."""
    muon_lr: float = 0.02
    """Muon learning rate of the blocks' matrices (``lr`` applies to the AdamW parameters)."""


@dataclass(kw_only=True, slots=True)
class LRScheduleConfig:
    """Learning-rate schedule: linear warm-up, then a decay."""

    warmup_steps: int = 20
    """Steps of linear warm-up from 0 to the peak LR."""
    decay: Literal["cosine", "linear", "wsd", "constant"] = "cosine"
    """Decay after warm-up: cosine, linear, warmup-stable-decay, or none."""
    min_lr_ratio: float = 0.1
    """Final LR as a fraction of the peak."""
    wsd_decay_fraction: float = 0.2
    """For wsd: fraction of the steps spent in the final linear decay."""


@dataclass(kw_only=True, slots=True)
class TrainingConfig:
    """The loop itself."""

    steps: int = 200
    """Optimizer steps to run."""
    batch_size: int = 8
    """Sequences per optimizer step per data-parallel rank (before accumulation split)."""
    seq_len: int = 128
    """Tokens per sequence (documents are packed to this length)."""
    grad_accum: int = 1
    """Micro-steps per optimizer step; batch_size must be divisible by it."""
    max_grad_norm: float = 1.0
    """Global gradient-norm clip; 0 disables clipping."""
    seed: int = 0
    """Seed for weights, data order and dropout."""
    deterministic: bool = True
    """Use deterministic algorithms (bitwise-repeatable runs on CPU)."""
    mixed_precision: Literal["fp32", "bf16"] = "fp32"
    """Parameter/compute dtype; bf16 keeps fp32 master weights and reductions."""
    skip_nonfinite: int = 0
    """Steps with a non-finite gradient norm that may be skipped (no update) before the run
    stops; 0: the first non-finite loss or norm stops the run, found at the next log step or
    checkpoint (no host read per step). > 0 reads one flag per step on the host."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where each rank trains: auto takes the accelerator (``torch.accelerator``, device
    ``LOCAL_RANK``) when there is one, else the CPU."""


@dataclass(kw_only=True, slots=True)
class CommConfig:
    """Process groups: their timeout, and the fake backend that runs one rank of a large job."""

    timeout_s: float = 600.0
    """Timeout of every collective (and of process-group setup), in seconds."""
    fake_world_size: int = 0
    """> 0: fake-backend mode. Run rank 0 of a job of this many ranks on this machine with a
    fake process group and fake tensors (nothing is allocated or communicated) and write
    ``memory.json``; 0: a real run."""


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Where training text comes from and how it is tokenized."""

    source: Literal["arithmetic", "files", "chat", "shapes", "image_files"] = "arithmetic"
    """arithmetic: the built-in generated corpus; files: local json/jsonl/parquet/text;
    chat: conversations (chat SFT: the loss on the assistant turns), from data.paths or a
    built-in corpus (data.chat_environment); shapes: the built-in image-text
    corpus (pictures of shapes, questions with checkable answers) for vision-language models;
    image_files: a local image-text dataset (HF ``datasets``: an imagefolder, or
    json/jsonl/parquet with image paths)."""
    paths: tuple[str, ...] = ()
    """Local data files for source=files / image_files (or one imagefolder folder)."""
    text_field: str = "text"
    """Field holding the text in json/jsonl/parquet records."""
    messages_field: str = "messages"
    """source=chat: field holding a record's list of messages (role, content, tool_calls)."""
    chat_environment: str = ""
    """source=chat without paths: a built-in corpus: ``digits`` (generated tasks on digits:
    reverse, first, last) or an RL environment's demonstrations (sorting, tool_calc, search,
    code: correct transcripts of its scripted solver)."""
    chat_train_on: Literal["assistant", "all"] = "assistant"
    """source=chat: the tokens that carry a loss: the assistant turns, or every token."""
    chat_overlong: Literal["truncate", "drop"] = "truncate"
    """source=chat: a conversation longer than training.seq_len is truncated or dropped
    (counted either way)."""
    tokenizer: str = "byte"
    """byte (built in), or a path to an HF tokenizer.json."""
    validation_fraction: float = 0.01
    """Fraction of documents held out for validation (by document index)."""
    streaming: bool = False
    """source=files / chat with data.paths: each data-parallel rank streams only its own files
    (HF split_dataset_by_node; needs >= dp files), every epoch shuffled through
    data.shuffle_buffer. Off: every rank reads every file and keeps every dp-th record."""
    shuffle_buffer: int = 10_000
    """Records in the seeded shuffle buffer (HF IterableDataset.shuffle), reshuffled every
    epoch (without data.streaming: from the second epoch on); 0 keeps the files' order."""
    arithmetic_slip_rate: float = 0.0
    """source=arithmetic: chance that a + / - document's answer is written with a systematic
    slip (carry-less +, borrow-less -; titan_train.data.arithmetic.slip_answer) instead of the true one. 0: the
    clean corpus. Used by the arith_grpo RL recipe's pre-training run."""
    arithmetic_reverse_answer: bool = False
    """source=arithmetic: write answers least-significant digit first ("47+38=58" for 85)."""
    image_min_pixels: int = 1024
    """Image-text data: smaller images are scaled up to this many pixels (HF processor)."""
    image_max_pixels: int = 16384
    """Image-text data: the pixel budget of one image; a larger image is an error naming it."""
    skip_too_long: bool = False
    """Image-text data: count and skip a sample longer than training.seq_len instead of
    stopping with an error naming it."""
    skip_bad_images: bool = False
    """Image-text data: count and skip a sample whose image cannot be decoded or is over
    image_max_pixels instead of stopping with an error naming it."""
    image_field: str = "image"
    """source=image_files: the column holding the image (path or bytes)."""
    question_field: str = "question"
    """source=image_files: the column holding the question text."""
    answer_field: str = "answer"
    """source=image_files: the column holding the answer text (the loss is on it)."""


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpointing through torch_checkpointing."""

    interval: int = 50
    """Save every N steps and at the last one (so a rerun of the same command resumes, and a
    finished run is known as such); 0 disables checkpoints."""
    keep_last: int = 2
    """Complete checkpoints to keep (older ones are deleted once a newer one is complete)."""
    async_mode: Literal["thread", "process", "off"] = "thread"
    """How saves are written in the background."""
    resume: bool = True
    """Resume from the latest complete checkpoint in the run folder."""
    init_from_hf: str = ""
    """HF folder to take initial weights from (empty: random init)."""
    export_hf: bool = False
    """Write an HF safetensors export of the final weights to runs/<name>/hf."""


@dataclass(kw_only=True, slots=True)
class RematConfig:
    """Activation rematerialisation through torch_remat, per block."""

    policy: Literal["none", "full", "selective", "every_nth"] = "none"
    """Policy applied to every transformer block."""
    every_nth: int = 2
    """For every_nth: checkpoint one block in n."""


@dataclass(kw_only=True, slots=True)
class QuantizeConfig:
    """Low-precision GEMMs (titan_models.quantize_modules), swapped in on the meta model
    before parallelisation; master weights keep their dtype."""

    linear: Literal["none", "fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4"] = "none"
    """Recipe of the linear layers' forward and backward GEMMs: per-tensor or per-row FP8
    scales, MXFP8 (e8m0 scale per 32 elements along the reduction dim), or NVFP4 (E2M1, an e4m3
    scale per 16 elements, an fp32 scale per tensor; gradients too; kernels on sm100 only)."""
    experts: Literal["none", "fp8_tensorwise", "fp8_rowwise", "mxfp8"] = "none"
    """Recipe of the routed experts' grouped GEMMs (MoE models; no nvfp4)."""
    grad_dtype: Literal["e4m3", "e5m2"] = "e4m3"
    """fp8 format of the output gradients in the backward GEMMs (inputs, weights: e4m3); fp8
    recipes only (nvfp4 gradients are NVFP4)."""
    kernels: Literal["auto", "emulated"] = "auto"
    """auto: the device's fp8 kernels on CUDA (an error where it has none for the recipe),
    emulation elsewhere; emulated: quantise and dequantise as the kernels would, multiply in
    fp32, on any device."""
    include: tuple[str, ...] = ()
    """Module globs to quantise ('*' within a segment, '**' a run of them); empty: every
    linear / experts module (router gates always stay in high precision)."""
    exclude: tuple[str, ...] = ("output",)
    """Module globs left in high precision."""


@dataclass(kw_only=True, slots=True)
class LoRAConfig:
    """LoRA fine-tuning (titan_models.apply_lora): the base model frozen, low-rank adapters on
    the targeted linears / routed experts trained; checkpoints hold the adapters only."""

    rank: int = 0
    """Adapter rank r; 0 turns LoRA off."""
    alpha: float = 16.0
    """Adapter scale numerator: the update is (alpha / rank) * B @ A."""
    targets: tuple[str, ...] = ("layers.*.attention.w*", "layers.*.feed_forward.w*")
    """Module globs of the linears (or routed ``experts`` modules) to adapt ('*' within a
    segment, '**' a run of them); each must match at least one."""
    dropout: float = 0.0
    """Dropout on the adapters' input (linears only)."""


@dataclass(kw_only=True, slots=True)
class FlexShardConfig:
    """Options of flexshard's data-parallel sharding."""

    fp8_gather: bool = False
    """All-gather the quantised linears' weights as e4m3 tiles with power-of-two scales
    (BlockShard + quantize='fp8_block_pow2'): half the bytes of bf16, and the GEMMs'
    re-quantisation of the gathered weight is exact for MXFP8 (the weight is rounded once)."""
    fp8_block: int = 128
    """Tile edge of the FP8 gather, a multiple of 32 dividing both dims of every such weight."""


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """What is logged and where."""

    log_every: int = 10
    """Log a metrics line every N steps."""
    tensorboard: bool = True
    """Write TensorBoard event files."""
    peak_flops: float = 0.0
    """Peak FLOP/s per rank for MFU; 0 measures an fp32 matmul on this device."""
    validate_every: int = 50
    """Run validation every N steps; 0 disables it."""
    validation_batches: int = 4
    """Batches per validation run."""
    wandb: bool = False
    """Also log to Weights & Biases (the ``wandb`` package; ``WANDB_MODE=offline`` runs with
    no account or network, files under ``<run>/wandb``)."""
    wandb_project: str = "titan-train"
    """W&B project name (the run is named after ``name``)."""


@dataclass(kw_only=True, slots=True)
class JobConfig:
    """A complete training job: what a recipe returns and the CLI overrides."""

    name: str = "llama3_debug"
    """Run name: outputs go to <output_dir>/<name>/."""
    output_dir: str = "runs"
    """Folder that holds run folders."""
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    remat: RematConfig = field(default_factory=RematConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)
    flexshard: FlexShardConfig = field(default_factory=FlexShardConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    fault_tolerance: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)
    overwrite: bool = False
    """With --checkpoint.no-resume in a run folder that holds checkpoints: move the old run's
    outputs to <run>/archive/<time>/ and start over (nothing is deleted)."""
    allow_config_change: bool = False
    """When resuming: apply changed lr / steps / checkpoint / metrics settings from the resumed
    step (recorded in config.json's history) instead of refusing."""


def validate(cfg: JobConfig) -> None:
    """Reject values no job can run with, naming the field and what is allowed."""
    t = cfg.training
    if cfg.comm.fake_world_size and t.steps == 0:
        pass  # a fake-backend plan with no step (--dry-run)
    else:
        _positive("training.steps", t.steps)
    _positive("training.batch_size", t.batch_size)
    _positive("training.seq_len", t.seq_len)
    _positive("training.grad_accum", t.grad_accum)
    if t.batch_size % t.grad_accum:
        raise ValueError(
            f"training.batch_size={t.batch_size} must be divisible by "
            f"training.grad_accum={t.grad_accum}"
        )
    if not (math.isfinite(t.max_grad_norm) and t.max_grad_norm >= 0):
        raise ValueError(
            f"training.max_grad_norm={t.max_grad_norm} must be a finite number >= 0 (0 disables)"
        )
    if t.skip_nonfinite < 0:
        raise ValueError(f"training.skip_nonfinite={t.skip_nonfinite} must be >= 0")
    o = cfg.optimizer
    for name in ("lr", "muon_lr", "eps"):
        _finite_positive(f"optimizer.{name}", getattr(o, name))
    for i, beta in enumerate(o.betas):
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"optimizer.betas[{i}]={beta} must be in [0, 1)")
    if not 0.0 <= o.momentum < 1.0:
        raise ValueError(f"optimizer.momentum={o.momentum} must be in [0, 1)")
    if not (math.isfinite(o.weight_decay) and o.weight_decay >= 0):
        raise ValueError(f"optimizer.weight_decay={o.weight_decay} must be a finite number >= 0")
    if not (math.isfinite(cfg.metrics.peak_flops) and cfg.metrics.peak_flops >= 0):
        raise ValueError(
            f"metrics.peak_flops={cfg.metrics.peak_flops} must be > 0 (FLOP/s per rank), or 0 "
            "to measure it"
        )
    from titan_train.profiling import parse_steps

    parse_steps(cfg.profiling.trace_steps)
    if cfg.profiling.flight_recorder < 0:
        raise ValueError(
            f"profiling.flight_recorder={cfg.profiling.flight_recorder} must be >= 0 "
            "(collectives kept per process group; 0: off)"
        )
    if cfg.moe.dispatch not in ("all_to_all", "symm_mem"):
        raise ValueError(f"moe.dispatch={cfg.moe.dispatch!r} must be 'all_to_all' or 'symm_mem'")
    if cfg.moe.grouped_gemm not in ("torch", "triton", "cute"):
        raise ValueError(
            f"moe.grouped_gemm={cfg.moe.grouped_gemm!r} must be 'torch', 'triton' or 'cute'"
        )
    if cfg.moe.symm_mem_max_tokens < 0:
        raise ValueError(f"moe.symm_mem_max_tokens={cfg.moe.symm_mem_max_tokens} must be >= 0")
    s = cfg.lr_schedule
    if s.warmup_steps < 0:
        raise ValueError(f"lr_schedule.warmup_steps={s.warmup_steps} must be >= 0")
    if not 0.0 <= s.min_lr_ratio <= 1.0:
        raise ValueError(f"lr_schedule.min_lr_ratio={s.min_lr_ratio} must be in [0, 1]")
    if not 0.0 < s.wsd_decay_fraction <= 1.0:
        raise ValueError(f"lr_schedule.wsd_decay_fraction={s.wsd_decay_fraction} must be in (0, 1]")
    d = cfg.data
    if d.source in ("files", "image_files") and not d.paths:
        raise ValueError(
            f"data.paths is empty: data.source={d.source!r} needs at least one file or folder"
        )
    if d.source == "chat" and bool(d.paths) == bool(d.chat_environment):
        raise ValueError(
            "data.source='chat' takes either data.paths (conversation files) or "
            f"data.chat_environment (a built-in corpus), got paths={list(d.paths)} and "
            f"chat_environment={d.chat_environment!r}"
        )
    if not 0 < d.image_min_pixels <= d.image_max_pixels:
        raise ValueError(
            f"data.image_min_pixels={d.image_min_pixels} must be in (0, data.image_max_pixels="
            f"{d.image_max_pixels}]"
        )
    if d.shuffle_buffer < 0:
        raise ValueError(f"data.shuffle_buffer={d.shuffle_buffer} must be >= 0 (0: no shuffle)")
    if d.streaming and (d.source not in ("files", "chat") or not d.paths):
        got = "'chat' with data.chat_environment" if d.source == "chat" else repr(d.source)
        raise ValueError(
            "data.streaming needs data.source='files', or 'chat' with data.paths (local "
            f"json/jsonl/parquet/txt files, dealt to ranks), got data.source={got}; drop "
            "--data.streaming"
        )
    if not 0.0 <= d.validation_fraction < 1.0:
        raise ValueError(f"data.validation_fraction={d.validation_fraction} must be in [0, 1)")
    if not 0.0 <= d.arithmetic_slip_rate <= 1.0:
        raise ValueError(f"data.arithmetic_slip_rate={d.arithmetic_slip_rate} must be in [0, 1]")
    if cfg.model.attention_backend not in _BUILTIN_ATTENTION_BACKENDS:
        import titan_models  # torch: only for a backend registered beyond the built-in ones

        backends = ["auto", *titan_models.attention_backends()]
        if cfg.model.attention_backend not in backends:
            raise ValueError(
                f"model.attention_backend={cfg.model.attention_backend!r} is not one of {backends}"
            )
    p = cfg.parallel
    for name in ("dp_replicate", "tp", "pp", "ep", "cp"):
        _positive(f"parallel.{name}", getattr(p, name))
    if p.dp_shard != -1:
        _positive("parallel.dp_shard", p.dp_shard)
    if p.cp > 1 and t.seq_len % (2 * p.cp):
        raise ValueError(
            f"training.seq_len={t.seq_len} must be divisible by 2 * parallel.cp = {2 * p.cp} "
            "(each rank holds two equal chunks of every sequence)"
        )
    if p.cp > 1 and cfg.model.attention_backend not in ("auto", "context_parallel"):
        raise ValueError(
            f"model.attention_backend={cfg.model.attention_backend!r} cannot attend across the "
            f"shards of parallel.cp={p.cp}; use 'auto' or 'context_parallel'"
        )
    if p.cp == 1 and cfg.model.attention_backend == "context_parallel":
        raise ValueError(
            "model.attention_backend='context_parallel' needs parallel.cp > 1 (use 'auto')"
        )
    _positive("parallel.cp_tile_scores", p.cp_tile_scores)
    if p.cp_algorithm not in ("ring", "allgather"):
        raise ValueError(
            f"parallel.cp_algorithm={p.cp_algorithm!r} must be one of ['ring', 'allgather']"
        )
    if p.cp_tile_kernel not in ("torch", "flex", "sdpa"):
        raise ValueError(
            f"parallel.cp_tile_kernel={p.cp_tile_kernel!r} must be one of ['torch', 'flex', 'sdpa']"
        )
    _positive("parallel.pp_microbatches", p.pp_microbatches)
    if cfg.checkpoint.interval < 0:
        raise ValueError(f"checkpoint.interval={cfg.checkpoint.interval} must be >= 0")
    _positive("checkpoint.keep_last", cfg.checkpoint.keep_last)
    _positive("metrics.log_every", cfg.metrics.log_every)
    if cfg.metrics.validate_every < 0:
        raise ValueError(f"metrics.validate_every={cfg.metrics.validate_every} must be >= 0")
    _positive("remat.every_nth", cfg.remat.every_nth)
    _finite_positive("comm.timeout_s", cfg.comm.timeout_s)
    if cfg.comm.fake_world_size < 0:
        raise ValueError(
            f"comm.fake_world_size={cfg.comm.fake_world_size} must be >= 0 (0: a real run)"
        )
    q = cfg.quantize
    if q.linear == "nvfp4" and q.grad_dtype != "e4m3":
        raise ValueError(
            f"quantize.grad_dtype={q.grad_dtype!r} applies to the fp8 recipes; "
            "quantize.linear='nvfp4' quantises gradients to NVFP4 (leave it at 'e4m3')"
        )
    f = cfg.flexshard
    if f.fp8_block < 32 or f.fp8_block % 32:
        raise ValueError(
            f"flexshard.fp8_block={f.fp8_block} must be a positive multiple of 32 (MX blocks of "
            "32 must lie inside one tile)"
        )
    if f.fp8_gather and cfg.quantize.linear == "none":
        raise ValueError(
            "flexshard.fp8_gather gathers the weights the FP8 GEMMs read: it needs "
            "quantize.linear other than 'none'"
        )
    if f.fp8_gather and q.linear == "nvfp4":
        raise ValueError(
            "flexshard.fp8_gather with quantize.linear='nvfp4' is not supported (its e4m3 tiles "
            "would round the weights once more before the NVFP4 quantisation)"
        )
    if f.fp8_gather and cfg.optimizer.name == "muon":
        raise ValueError(
            "flexshard.fp8_gather with optimizer.name='muon' is not supported (Muon keeps the "
            "matrices Owned, whole on one rank: there is nothing to gather in tiles)"
        )
    _validate_lora(cfg.lora)
    validate_fault_tolerance(cfg)
    if not cfg.name or "/" in cfg.name or cfg.name in (".", ".."):
        raise ValueError(f"name={cfg.name!r} must be a non-empty folder name without '/'")


def _validate_lora(lora: LoRAConfig) -> None:
    if isinstance(lora.rank, bool) or not isinstance(lora.rank, int) or lora.rank < 0:
        raise ValueError(f"lora.rank={lora.rank!r} must be an int >= 0 (0: LoRA off)")
    if not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise ValueError(f"lora.alpha={lora.alpha} must be a finite number > 0")
    if not 0.0 <= lora.dropout < 1.0:
        raise ValueError(f"lora.dropout={lora.dropout} must be in [0, 1)")
    if lora.rank > 0 and not lora.targets:
        raise ValueError(
            f"lora.targets={list(lora.targets)} must name at least one module glob when "
            f"lora.rank={lora.rank} > 0 (e.g. 'layers.*.attention.w*')"
        )


def check_paths(cfg: JobConfig) -> None:
    """Reject paths a job cannot use, before anything is built: one ``ValueError`` naming the
    field, the path and what is wrong (missing, not a folder, unreadable, not writable)."""
    hf = cfg.checkpoint.init_from_hf
    if hf:
        if not Path(hf).is_dir():
            what = "is not a folder" if Path(hf).exists() else "does not exist"
            raise ValueError(f"checkpoint.init_from_hf={hf!r} {what} (an HF checkpoint folder)")
        if not (Path(hf) / "config.json").is_file():
            raise ValueError(
                f"checkpoint.init_from_hf={hf!r} has no config.json: not an HF checkpoint folder"
            )
    _check_output_dir(cfg)
    for path in cfg.data.paths if cfg.data.source in ("files", "image_files") else ():
        if not Path(path).exists():
            raise ValueError(f"data.paths: {path!r} does not exist")
        if not os.access(path, os.R_OK):
            raise ValueError(f"data.paths: {path!r} is not readable")


def _check_output_dir(cfg: JobConfig) -> None:
    """The run folder ``output_dir/name`` can be created (or written, if it exists): every
    folder on the way that exists is a folder, and the nearest one accepts a new folder. The
    last is tried for real (a folder made and removed at once): ``os.access`` says yes to root
    on a read-only mount or under ``/proc``."""
    out = Path(cfg.output_dir)
    run_dir = out / cfg.name
    existing = None
    for path in (run_dir, *run_dir.parents):
        if path.exists() or path.is_symlink():
            existing = path
            break
    if existing is None:  # a relative path always reaches "."
        return
    if not existing.is_dir():
        field_name = "name" if existing == run_dir else "output_dir"
        value = cfg.name if existing == run_dir else cfg.output_dir
        raise ValueError(
            f"{field_name}={value!r}: {str(existing)!r} is "
            f"{'a file' if existing.is_file() else 'not a folder'}; runs are written to a folder "
            "(pass an --output-dir that is a folder or does not exist yet)"
        )
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".titan-train-probe-", dir=existing))
    except OSError as e:
        raise ValueError(
            f"output_dir={cfg.output_dir!r}: cannot create the run folder {str(run_dir)!r}: "
            f"{str(existing)!r} refuses a new folder ({e.strerror}); pass an --output-dir on "
            "a writable disk"
        ) from None


_BUILTIN_ATTENTION_BACKENDS = ("auto", "context_parallel", "flex", "sdpa", "varlen")
"""titan_models' own attention backends (checked without importing torch)."""


def _finite_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}={value} must be a finite number > 0")


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name}={value} must be >= 1")
