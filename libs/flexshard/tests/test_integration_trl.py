"""TRL's SFTTrainer trains a flexshard-sharded transformers Llama on 2 gloo ranks exactly as one
process trains the unsharded model (``flexshard.integrations.hf.FlexShardTrainerMixin``).

The reported bug this guards: under Trainer / TRL / Accelerate on 2 processes, Accelerate
wrapped the sharded model in DDP, whose constructor broadcast rank 0's shards over rank 1's;
the run finished normally with corrupted weights. Here the plain SFTTrainer must now raise, and
the mixin's run must match the one-process losses and gradient norms step for step.

One 2-rank spawn and one 1-process spawn (the reference, no process group at all); fp32,
dropout off, a fixed dataset of equal-length rows (no padding) in a seeded order, the same
global batch per optimizer step (1 process: 2 rows x 2 accumulation micro-steps; 2 ranks: 1 row
x 2 micro-steps each), TRL's default HF gradient checkpointing on, clipping active.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
import torch

from titan_testing import run_distributed

pytest.importorskip("trl")

# The tests on `runs`: three processes importing transformers + TRL and building several
# trainers, 1-4 min on 2 loaded cores; hence slow.

STEPS, ROWS, SEQ, VOCAB, GLOBAL_BATCH, ACCUM = 5, 20, 16, 64, 4, 2
MAX_GRAD_NORM = 0.05  # below the measured norms (~0.3-1): every step clips
LOSS_TOL = 1e-6


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.0,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)  # the same full weights on every rank
    return LlamaForCausalLM(cfg).float()


def _tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tok = Tokenizer(WordLevel(vocab, unk_token="t3"))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="t0", eos_token="t1", bos_token="t2", unk_token="t3"
    )


def _dataset():
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    ids = torch.randint(4, VOCAB, (ROWS, SEQ), generator=g)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def _config(out_dir: str, world: int, **overrides):
    from trl import SFTConfig

    args = dict(
        output_dir=out_dir,
        per_device_train_batch_size=GLOBAL_BATCH // world // ACCUM,
        gradient_accumulation_steps=ACCUM,
        max_steps=STEPS,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        max_grad_norm=MAX_GRAD_NORM,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),  # else Accelerate sees one process, not gloo ranks
        bf16=False,
        fp16=False,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        max_length=SEQ,
        disable_tqdm=True,
        dataset_num_proc=None,
    )
    return SFTConfig(**{**args, **overrides})


def _trainer(trainer_cls, model, out_dir: str, world: int):
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def __init__(self) -> None:
            self.rows: list[tuple[float, float]] = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.rows.append((float(logs["loss"]), float(logs["grad_norm"])))

    rec = Record()
    trainer = trainer_cls(
        model=model,
        args=_config(out_dir, world),
        train_dataset=_dataset(),
        processing_class=_tokenizer(),
        callbacks=[rec],
    )
    return trainer, rec


def _reference(out_dir: str) -> dict:
    from trl import SFTTrainer

    # a plain single process: no rank variables, so Accelerate takes DistributedType.NO
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)

    model = _model()
    init = {k: v.clone() for k, v in model.state_dict().items()}
    trainer, rec = _trainer(SFTTrainer, model, out_dir, world=1)
    trainer.train()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moved = max((weights[k] - init[k]).abs().max().item() for k in init)
    return {"rows": rec.rows, "weights": weights, "moved": moved}


def _ranks(out_dir: str) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch.nn.parallel import DistributedDataParallel as DDP
    from trl import SFTTrainer

    import flexshard as fs
    from flexshard.integrations.accelerate import FlexShardAccelerator
    from flexshard.integrations.hf import FlexShardTrainerMixin

    out: dict = {}
    world = dist.get_world_size()

    # The user's setup: the plain trainer. Accelerate's DDP wrap is refused before its
    # broadcast (before the guard: trained on with every rank holding rank 0's shards).
    plain, _ = _trainer(SFTTrainer, fs.shard(_model()), out_dir, world)
    try:
        plain.train()
        out["plain_error"] = None
    except RuntimeError as e:
        out["plain_error"] = str(e)
    del plain

    class FlexShardSFTTrainer(FlexShardTrainerMixin, SFTTrainer):
        pass

    out["bad_input"] = _bad_input(FlexShardSFTTrainer, out_dir, world)

    model = fs.shard(_model())
    trainer, rec = _trainer(FlexShardSFTTrainer, model, out_dir, world)
    trainer.train()
    out["rows"] = rec.rows
    out["wrapped"] = type(trainer.model_wrapped).__name__
    out["accelerator_is_flexshard"] = type(trainer.accelerator) is FlexShardAccelerator
    out["ddp_anywhere"] = isinstance(trainer.model_wrapped, DDP)
    opt_params = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    out["optimizer_steps_shards"] = bool(opt_params) and all(
        fs.param_info(p) is not None for p in opt_params
    )
    n = torch.tensor(sum(p.numel() for p in opt_params))
    dist.all_reduce(n)
    out["optimizer_numel_over_ranks"] = int(n)
    out["reduced_bytes"] = sum(v for k, v in fs.comm_stats(model).bytes.items() if "reduce" in k)

    acc_sd = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # collective: gathers
    try:
        trainer.accelerator.save_state(os.path.join(out_dir, "state"))
        out["save_state_error"] = None
    except ValueError as e:
        out["save_state_error"] = str(e)
    out["no_state_written"] = not os.path.exists(os.path.join(out_dir, "state"))

    full = fs.full_state_dict(model, rank0_only=True)  # collective
    trainer.save_model(os.path.join(out_dir, "final"))  # collective: every rank gathers
    dist.barrier()
    if dist.get_rank() == 0:
        saved = load_file(os.path.join(out_dir, "final", "model.safetensors"))
        out["saved_equals_gathered"] = set(saved) == set(full) and all(
            torch.equal(saved[k], full[k]) for k in full
        )
        out["weights"] = full
        out["accelerator_sd_equals_gathered"] = all(torch.equal(acc_sd[k], full[k]) for k in full)
    return out


def _bad_input(trainer_cls, out_dir: str, world: int) -> dict[str, str]:
    """What the mixin refuses, each with a ValueError before any training or file."""
    import flexshard as fs

    errors: dict[str, str] = {}

    def expect(case: str, fn) -> None:
        try:
            fn()
            errors[case] = "no error"
        except ValueError as e:
            errors[case] = str(e)

    cfg = _config(out_dir, world)
    data, tok = _dataset(), _tokenizer()
    expect("unsharded", lambda: trainer_cls(model=_model(), args=cfg, train_dataset=data))
    inner_only = _model()
    fs.shard(inner_only.model)  # the decoder sharded, the LM head left to a framework
    expect("submodule_only", lambda: trainer_cls(model=inner_only, args=cfg, train_dataset=data))
    ckpt = _config(out_dir, world, save_strategy="steps", save_steps=1)
    expect(
        "optimizer_checkpoints",
        lambda: trainer_cls(
            model=fs.shard(_model()), args=ckpt, train_dataset=data, processing_class=tok
        ),
    )
    t = trainer_cls(model=fs.shard(_model()), args=cfg, train_dataset=data, processing_class=tok)
    expect("resume", lambda: t.train(resume_from_checkpoint=out_dir))
    errors["trained_nothing"] = str(t.state.global_step == 0)
    return errors


def test_importing_the_integrations_imports_no_hf_package():
    code = (
        "import sys, flexshard, flexshard.integrations.hf, flexshard.integrations.accelerate; "
        "print(sorted({'accelerate', 'transformers', 'trl'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout


@pytest.fixture(scope="module")
def runs():
    with tempfile.TemporaryDirectory() as ref_dir, tempfile.TemporaryDirectory() as dist_dir:
        env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        ref = run_distributed(
            _reference, 1, ref_dir, init_process_group=False, num_threads=1, env=env, timeout=600
        )[0]
        out = run_distributed(_ranks, 2, dist_dir, num_threads=1, env=env, timeout=600)
    return ref, out


@pytest.mark.slow
def test_plain_trainer_on_a_sharded_model_raises_instead_of_corrupting(runs):
    _, out = runs
    for o in out:
        assert o["plain_error"] is not None, "Accelerate wrapped the sharded model in DDP"
        assert "FlexShardTrainerMixin" in o["plain_error"], o["plain_error"]


@pytest.mark.slow
def test_the_mixin_refuses_what_it_cannot_do_right(runs):
    _, out = runs
    for o in out:
        e = o["bad_input"]
        assert "must be a module sharded by flexshard.shard" in e["unsharded"], e
        assert "not sharded itself" in e["submodule_only"], e
        assert "save_only_model=True" in e["optimizer_checkpoints"], e
        assert "resume_from_checkpoint" in e["resume"], e
        assert e["trained_nothing"] == "True"
        assert "save_state" in o["save_state_error"] and o["no_state_written"]
    assert out[0]["accelerator_sd_equals_gathered"]


@pytest.mark.slow
def test_sft_losses_and_grad_norms_match_one_process(runs):
    ref, out = runs
    assert len(ref["rows"]) == STEPS
    for o in out:
        assert len(o["rows"]) == STEPS
        for step, ((loss, gn), (rloss, rgn)) in enumerate(zip(o["rows"], ref["rows"], strict=True)):
            assert abs(loss - rloss) <= LOSS_TOL, (step, loss, rloss)
            # the global norm (not this rank's shards'), and above the clip: clipping acted
            assert abs(gn - rgn) <= 1e-5 * rgn, (step, gn, rgn)
            assert rgn > MAX_GRAD_NORM
    # training moved the weights: the runs are not compared on an untrained model
    assert ref["moved"] > 1e-3
    print("1 process (loss, grad_norm):", ref["rows"])
    print("2 ranks   (loss, grad_norm):", out[0]["rows"])
    diff = max(abs(a[0] - b[0]) for a, b in zip(out[0]["rows"], ref["rows"], strict=True))
    print("max |loss difference|:", diff)


@pytest.mark.slow
def test_flexshard_reduces_and_the_optimizer_steps_the_shards(runs):
    ref, out = runs
    total = sum(v.numel() for v in ref["weights"].values())
    for o in out:
        assert not o["ddp_anywhere"], o["wrapped"]
        assert o["accelerator_is_flexshard"]
        assert o["optimizer_steps_shards"]
        assert o["optimizer_numel_over_ranks"] == total  # each element on exactly one rank
        assert o["reduced_bytes"] > 0


@pytest.mark.slow
def test_saved_model_is_the_gathered_full_model_and_matches_one_process(runs):
    ref, out = runs
    assert out[0]["saved_equals_gathered"]
    w = out[0]["weights"]
    assert set(w) == set(ref["weights"])
    for k, v in ref["weights"].items():
        assert w[k].shape == v.shape, k
        torch.testing.assert_close(w[k], v, rtol=0, atol=1e-5, msg=k)
