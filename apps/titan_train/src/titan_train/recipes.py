"""Named recipes: plain functions returning a ``JobConfig``."""

from __future__ import annotations

from collections.abc import Callable

from titan_train.config import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    LRScheduleConfig,
    MetricsConfig,
    ModelConfig,
    OptimizerConfig,
    ParallelConfig,
    RematConfig,
    TrainingConfig,
)

DEFAULT_RECIPE = "llama3_debug"
_RECIPES: dict[str, Callable[[], JobConfig]] = {}


def recipe(fn: Callable[[], JobConfig]) -> Callable[[], JobConfig]:
    """Register ``fn`` under its own name."""
    _RECIPES[fn.__name__] = fn
    return fn


def list_recipes() -> dict[str, str]:
    """Recipe name -> first line of its docstring."""
    return {n: (f.__doc__ or "").strip().splitlines()[0] for n, f in sorted(_RECIPES.items())}


def get_recipe(name: str) -> JobConfig:
    """A fresh config of recipe ``name``."""
    if name not in _RECIPES:
        raise ValueError(f"--recipe {name!r} is unknown; recipes: {', '.join(sorted(_RECIPES))}")
    return _RECIPES[name]()


@recipe
def llama3_debug() -> JobConfig:
    """Tiny Llama 3 on the built-in arithmetic corpus; trains on 2 CPU cores in minutes."""
    return JobConfig(
        name="llama3_debug",
        model=ModelConfig(family="llama3", flavor="debug"),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(warmup_steps=20, decay="cosine", min_lr_ratio=0.1),
        training=TrainingConfig(steps=200, batch_size=8, seq_len=128),
    )


@recipe
def llama3_debug_sft() -> JobConfig:
    """Tiny Llama 3, chat SFT on the built-in ``facts`` conversations (one to three questions:
    capitals, opposites, weekdays, sums): the loss on the assistant turns only; validation
    reports the exact-match rate of held-out conversations (``answer_accuracy``)."""
    cfg = llama3_debug()
    cfg.name = "llama3_debug_sft"
    cfg.data = DataConfig(source="chat", chat_environment="facts")
    cfg.training = TrainingConfig(steps=1000, batch_size=8, seq_len=256)
    cfg.optimizer.lr = 1e-3  # 3e-3 (the pre-training rate) memorises the facts more slowly
    cfg.metrics.validate_every = 100
    cfg.metrics.validation_batches = 8
    return cfg


@recipe
def qwen3_debug() -> JobConfig:
    """Tiny Qwen3 (QK-norm, tied head) on the built-in arithmetic corpus."""
    cfg = llama3_debug()
    cfg.name = "qwen3_debug"
    cfg.model = ModelConfig(family="qwen3", flavor="debug")
    return cfg


@recipe
def qwen3_vl_debug() -> JobConfig:
    """Tiny Qwen3-VL on the built-in shapes corpus (count / colour / side questions); its
    validation answer accuracy rises from chance (1/3) within minutes on 2 CPU cores."""
    return JobConfig(
        name="qwen3_vl_debug",
        model=ModelConfig(family="qwen3_vl", flavor="debug"),
        data=DataConfig(source="shapes", image_max_pixels=64 * 64),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(warmup_steps=20, decay="cosine", min_lr_ratio=0.1),
        training=TrainingConfig(steps=300, batch_size=8, seq_len=128),
        metrics=MetricsConfig(validate_every=50, validation_batches=4),
    )


@recipe
def qwen3_vl_moe_debug() -> JobConfig:
    """Tiny Qwen3-VL-MoE (8 experts, top-2) on the built-in shapes corpus."""
    cfg = qwen3_vl_debug()
    cfg.name = "qwen3_vl_moe_debug"
    cfg.model = ModelConfig(family="qwen3_vl_moe", flavor="debug")
    return cfg


@recipe
def kimi_k25_debug() -> JobConfig:
    """Tiny Kimi K2.5 (DeepSeek-V3 decoder, 8 experts top-2, + a 2-block MoonViT) on the
    built-in shapes corpus, images through the image-text path (patches row by row); 60
    steps (the loss falls from ~5.5 below 1 in the first 30)."""
    cfg = qwen3_vl_debug()
    cfg.name = "kimi_k25_debug"
    cfg.model = ModelConfig(family="kimi_k25", flavor="debug")
    cfg.training.steps = 60
    cfg.lr_schedule.warmup_steps = 10
    cfg.metrics.validate_every = 20
    return cfg


@recipe
def muse_glimmer_debug() -> JobConfig:
    """Tiny Muse Glimmer (4 layers: NoPE + global on 0 and 3, sliding between; soft-capped
    head; a 2-block tower with window attention) on the built-in shapes corpus, images
    through the image-text path (patches row by row, each frame-major); 60 steps."""
    cfg = qwen3_vl_debug()
    cfg.name = "muse_glimmer_debug"
    cfg.model = ModelConfig(family="muse_glimmer", flavor="debug")
    cfg.training.steps = 60
    cfg.lr_schedule.warmup_steps = 10
    cfg.metrics.validate_every = 20
    return cfg


def _full_size(name: str, family: str, flavor: str, parallel: ParallelConfig) -> JobConfig:
    """A published-size model at a production layout. The vocabulary is the flavour's (the
    built-in byte tokenizer's ids fit in it; pass ``--data.tokenizer`` for the real one)."""
    import titan_models  # torch: only for the recipes that need a flavour's vocabulary

    vocab = titan_models.get_model(family, flavor)[1].vocab_size
    return JobConfig(
        name=name,
        model=ModelConfig(family=family, flavor=flavor, vocab_size=vocab),
        parallel=parallel,
        optimizer=OptimizerConfig(lr=3e-4, weight_decay=0.1),
        lr_schedule=LRScheduleConfig(warmup_steps=2000, decay="cosine", min_lr_ratio=0.1),
        training=TrainingConfig(
            steps=100_000, batch_size=1, seq_len=8192, mixed_precision="bf16", grad_accum=1
        ),
        checkpoint=CheckpointConfig(interval=500, keep_last=3, async_mode="process"),
        remat=RematConfig(policy="selective"),
    )


@recipe
def llama3_8b() -> JobConfig:
    """Llama 3.1 8B pre-training on 64 GPUs: FSDP 64, one 8192-token sequence per rank."""
    return _full_size("llama3_8b", "llama3", "8B", ParallelConfig(dp_shard=64))


@recipe
def llama3_70b() -> JobConfig:
    """Llama 3.1 70B on 256 GPUs: TP 8 within a node, PP 4 (interleaved), FSDP 8; full remat."""
    cfg = _full_size(
        "llama3_70b",
        "llama3",
        "70B",
        ParallelConfig(dp_shard=8, tp=8, pp=4, pp_schedule="interleaved_1f1b", pp_microbatches=8),
    )
    cfg.training.batch_size = 8
    cfg.remat = RematConfig(policy="full")  # 8 microbatches in flight on the first stage
    return cfg


@recipe
def llama3_405b() -> JobConfig:
    """Llama 3.1 405B on 512 GPUs: TP 8 within a node, PP 8 (interleaved, 16 stages), FSDP 8;
    full remat."""
    cfg = _full_size(
        "llama3_405b",
        "llama3",
        "405B",
        ParallelConfig(dp_shard=8, tp=8, pp=8, pp_schedule="interleaved_1f1b", pp_microbatches=8),
    )
    cfg.training.batch_size = 8
    cfg.remat = RematConfig(policy="full")
    return cfg


@recipe
def qwen3_32b() -> JobConfig:
    """Qwen3 32B on 128 GPUs: TP 8, FSDP 16; full remat."""
    cfg = _full_size("qwen3_32b", "qwen3", "32B", ParallelConfig(dp_shard=16, tp=8))
    cfg.remat = RematConfig(policy="full")
    return cfg


@recipe
def qwen3_moe_235b() -> JobConfig:
    """Qwen3-235B-A22B on 256 GPUs: PP 4, FSDP 64 with its 128 experts over EP 64 (two per
    GPU, their copies sharded over the other FSDP ranks)."""
    cfg = _full_size(
        "qwen3_moe_235b",
        "qwen3_moe",
        "235B-A22B",
        ParallelConfig(dp_shard=64, pp=4, ep=64, pp_microbatches=4),
    )
    cfg.training.seq_len = 4096
    cfg.training.batch_size = 4  # one sequence per pipeline microbatch
    return cfg


@recipe
def qwen3_moe_debug() -> JobConfig:
    """Tiny Qwen3-MoE (8 experts, top-2, softmax routing with balance loss) on arithmetic."""
    cfg = llama3_debug()
    cfg.name = "qwen3_moe_debug"
    cfg.model = ModelConfig(family="qwen3_moe", flavor="debug")
    return cfg


@recipe
def deepseek_v3_debug() -> JobConfig:
    """Tiny DeepSeek-V3 (MLA, dense first layer, shared + routed experts, aux-loss-free
    bias balancing, one MTP module) on arithmetic."""
    cfg = llama3_debug()
    cfg.name = "deepseek_v3_debug"
    cfg.model = ModelConfig(family="deepseek_v3", flavor="debug")
    return cfg


@recipe
def deepseek_v3_671b() -> JobConfig:
    """DeepSeek-V3 671B on 256 GPUs as in the published GB300 table: PP 2, FSDP 128, routed
    experts over EP 64 (four per GPU, each sharded over two FSDP ranks); full remat.

    Multi-token prediction is off: it needs the embedding and the head on one stage."""
    cfg = _full_size(
        "deepseek_v3_671b",
        "deepseek_v3",
        "671B",
        ParallelConfig(dp_shard=128, pp=2, ep=64, pp_microbatches=2),
    )
    cfg.model.num_mtp_modules = 0
    cfg.training.seq_len = 4096
    cfg.training.batch_size = 2
    cfg.remat = RematConfig(policy="full")
    return cfg


@recipe
def kimi_k25_1t() -> JobConfig:
    """Kimi K2.5 (1.03T: Kimi K2's decoder + MoonViT) on 256 GPUs: FSDP 256 with the 384
    routed experts over EP 128 (three per GPU, each sharded over two FSDP ranks), images of
    the shapes corpus at 14-pixel patches; full remat. (EP 64 gathers six experts per layer:
    259.7 GiB per rank in fake mode, over a GB300's 90 %.)"""
    cfg = _vision_language("kimi_k25_1t", "kimi_k25", "1T", ParallelConfig(dp_shard=256, ep=128))
    cfg.training.seq_len = 4096
    cfg.training.batch_size = 1
    cfg.remat = RematConfig(policy="full")
    return cfg


@recipe
def gpt_oss_debug() -> JobConfig:
    """Tiny gpt-oss (alternating window-16 / full attention with biases and learned sinks,
    8 biased clamped-SwiGLU experts top-2, YaRN) on arithmetic."""
    cfg = llama3_debug()
    cfg.name = "gpt_oss_debug"
    cfg.model = ModelConfig(family="gpt_oss", flavor="debug")
    return cfg


@recipe
def gpt_oss_120b() -> JobConfig:
    """gpt-oss-120b pre-training on 64 GPUs: FSDP 64 with its 128 experts over EP 32 (four
    per GPU, each sharded over two FSDP ranks); full remat. Fake mode estimates ~88 GiB per
    rank at 2 × 8192 tokens (selective remat at 4 × 8192 would keep ~175 GiB of activations)."""
    cfg = _full_size("gpt_oss_120b", "gpt_oss", "120B", ParallelConfig(dp_shard=64, ep=32))
    cfg.training.batch_size = 2
    cfg.remat = RematConfig(policy="full")
    return cfg


@recipe
def deepseek_v4_debug() -> JobConfig:
    """Tiny DeepSeek-V4 (sliding / compressed-sparse / heavily-compressed attention, two
    hyper-connection streams, a hash-routed then learned MoE layers) on arithmetic."""
    cfg = llama3_debug()
    cfg.name = "deepseek_v4_debug"
    cfg.model = ModelConfig(family="deepseek_v4", flavor="debug")
    return cfg


@recipe
def deepseek_v4_flash() -> JobConfig:
    """DeepSeek-V4-Flash (284B, 13B active; HF config defaults) on 128 GPUs: PP 2, FSDP 64,
    its 256 routed experts over EP 64 (four per GPU); full remat, 4096-token sequences.

    Stages send the 4 hyper-connection streams and the token ids (hash-routed layers)."""
    cfg = _full_size(
        "deepseek_v4_flash",
        "deepseek_v4",
        "flash",
        ParallelConfig(dp_shard=64, pp=2, ep=64, pp_microbatches=2),
    )
    cfg.training.seq_len = 4096
    cfg.training.batch_size = 2
    cfg.remat = RematConfig(policy="full")
    return cfg


@recipe
def qwen3_5_debug() -> JobConfig:
    """Tiny Qwen3.5 (Gated DeltaNet + gated attention, alternating) on arithmetic."""
    cfg = llama3_debug()
    cfg.name = "qwen3_5_debug"
    cfg.model = ModelConfig(family="qwen3_5", flavor="debug")
    return cfg


@recipe
def qwen3_5_moe_debug() -> JobConfig:
    """Tiny Qwen3.5-MoE (Gated DeltaNet + gated attention, 8 experts top-2 + a gated shared
    expert) on arithmetic."""
    cfg = llama3_debug()
    cfg.name = "qwen3_5_moe_debug"
    cfg.model = ModelConfig(family="qwen3_5_moe", flavor="debug")
    return cfg


@recipe
def kimi_linear_debug() -> JobConfig:
    """Tiny Kimi Linear (Kimi Delta Attention + NoPE MLA, dense first block, sigmoid-routed
    experts with aux-loss-free balancing) on arithmetic."""
    cfg = llama3_debug()
    cfg.name = "kimi_linear_debug"
    cfg.model = ModelConfig(family="kimi_linear", flavor="debug")
    return cfg


@recipe
def qwen3_5_moe_35b_a3b() -> JobConfig:
    """Qwen3.5-35B-A3B on 64 GPUs: EP 64 = DP-shard 64 (four routed experts per GPU)."""
    cfg = _full_size(
        "qwen3_5_moe_35b_a3b", "qwen3_5_moe", "35B-A3B", ParallelConfig(dp_shard=64, ep=64)
    )
    cfg.training.seq_len = 4096
    return cfg


@recipe
def kimi_linear_48b_a3b() -> JobConfig:
    """Kimi Linear 48B-A3B on 64 GPUs: EP 64 = DP-shard 64 (four routed experts per GPU)."""
    cfg = _full_size(
        "kimi_linear_48b_a3b", "kimi_linear", "48B-A3B", ParallelConfig(dp_shard=64, ep=64)
    )
    cfg.training.seq_len = 4096
    return cfg


@recipe
def muse_spark_debug() -> JobConfig:
    """Tiny Muse Spark Open (gated attention, NoPE / sliding layers, residual gates, pooled MoE
    with a dense block among sparse ones, soft-capped head; a 2-block vision tower) on the
    built-in shapes corpus, images through the image-text path (patches row by row, each
    frame-major, as Muse Glimmer's); 60 steps."""
    cfg = qwen3_vl_debug()
    cfg.name = "muse_spark_debug"
    cfg.model = ModelConfig(family="muse_spark", flavor="debug")
    cfg.training.steps = 60
    cfg.lr_schedule.warmup_steps = 10
    cfg.metrics.validate_every = 20
    return cfg


def _muse_spark_open(name: str, seq_len: int, cp: int) -> JobConfig:
    """Muse-Spark-Open-816B-A42B (text) at the seed's layout: TP 4 within a node, CP ``cp``,
    FSDP 16, the 256 routed experts over EP 64 (four per GPU, carved out of FSDP x CP), one
    ``seq_len``-token sequence per data-parallel rank; full remat."""
    cfg = _full_size(name, "muse_spark", "816B", ParallelConfig(dp_shard=16, tp=4, cp=cp, ep=64))
    cfg.training.seq_len = seq_len
    cfg.training.batch_size = 1
    cfg.remat = RematConfig(policy="full")
    return cfg


@recipe
def muse_spark_open_96k() -> JobConfig:
    """Muse Spark Open 816B at 96K tokens on 256 GPUs: PP 1, DP 16, TP 4, CP 4, EP 64."""
    return _muse_spark_open("muse_spark_open_96k", 96 * 1024, cp=4)


@recipe
def muse_spark_open_192k() -> JobConfig:
    """Muse Spark Open 816B at 192K tokens on 512 GPUs: PP 1, DP 16, TP 4, CP 8, EP 64."""
    return _muse_spark_open("muse_spark_open_192k", 192 * 1024, cp=8)


def _vision_language(name: str, family: str, flavor: str, parallel: ParallelConfig) -> JobConfig:
    """A published-size Qwen3-VL model on the built-in shapes corpus (the model's own image
    processor settings: 16-pixel patches, 2 × 2 merge)."""
    cfg = _full_size(name, family, flavor, parallel)
    cfg.data = DataConfig(source="shapes")
    return cfg


@recipe
def qwen3_vl_8b() -> JobConfig:
    """Qwen3-VL-8B on 32 GPUs: TP 4 (the vision tower replicated) x FSDP 8; full remat."""
    cfg = _vision_language("qwen3_vl_8b", "qwen3_vl", "8B", ParallelConfig(dp_shard=8, tp=4))
    cfg.remat = RematConfig(policy="full")
    return cfg


@recipe
def qwen3_vl_moe_30b_a3b() -> JobConfig:
    """Qwen3-VL-30B-A3B on 64 GPUs: FSDP 64 with its 128 experts over EP 64 (two per GPU)."""
    return _vision_language(
        "qwen3_vl_moe_30b_a3b",
        "qwen3_vl_moe",
        "30B-A3B",
        ParallelConfig(dp_shard=64, ep=64),
    )
