"""LoRA fine-tuning through the app: the adapters train, the base stays frozen and out of the
checkpoints, data parallelism trains like one process, the merged export loads in
transformers."""

from __future__ import annotations

import glob
import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import titan_models
from titan_testing import run_distributed
from titan_train.build import build_model, build_optimizer, resolve
from titan_train.cli import parse_config
from titan_train.data.packing import Batch
from titan_train.errors import ConfigError
from titan_train.layout import ParallelDims
from titan_train.loaders import loaders as job_loaders
from titan_train.lr_schedule import build_lr_scheduler
from titan_train.materialize import local_bytes
from titan_train.parallelize import ParallelModel
from titan_train.trainer import train, train_step

STEPS = 6
COMMON = [
    "--training.steps", str(STEPS),
    "--training.batch-size", "4",
    "--training.seq-len", "64",
    "--lr-schedule.warmup-steps", "2",
    "--metrics.validate-every", "0",
    "--metrics.no-tensorboard",
    "--metrics.log-every", "1",
    "--metrics.peak-flops", "1e11",
    "--checkpoint.interval", "3",
    "--lora.rank", "4",
    "--lora.alpha", "8",
]  # fmt: skip
MOE = [
    "--model.family", "qwen3_moe",
    "--lora.targets", "layers.*.attention.w*", "layers.*.feed_forward.experts",
]  # fmt: skip
DP2 = ["--parallel.dp-shard", "2"]
WORLD2 = {
    "dp2": [*DP2, "--checkpoint.export-hf"],
    "pp2": ["--parallel.pp", "2", "--parallel.dp-shard", "1", "--parallel.pp-microbatches", "2"],
    # TP checkpoints of the optimizer are not supported by the app yet (with or without LoRA)
    "tp2": [
        "--parallel.tp", "2", "--parallel.dp-shard", "1", "--checkpoint.interval", "0",
        "--checkpoint.export-hf",
    ],
    "moe_ep2": [*MOE, *DP2, "--parallel.ep", "2", "--checkpoint.export-hf"],
}  # fmt: skip
TOKENS = torch.arange(64).reshape(2, 32) % 200


def _cfg(out: str, name: str, *argv: str):
    return parse_config(["--output-dir", out, "--name", name, *COMMON, *argv])


# --- one process --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora.rank", "-1"], "lora.rank=-1 must be an int >= 0"),
        (["--lora.alpha", "0"], "lora.alpha=0.0 must be a finite number > 0"),
        (["--lora.dropout", "1"], "lora.dropout=1.0 must be in [0, 1)"),
        (["--lora.targets"], "lora.targets=[] must name at least one module glob"),
    ],
)
def test_bad_lora_fields_are_one_error_naming_field_and_value(tmp_path, argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _cfg(str(tmp_path), "bad", *argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--lora.targets", "layers.*.attn.wq"], "lora.targets glob 'layers.*.attn.wq' matches no"),
        (["--lora.targets", "layers.*.attention"], "matches 'layers.0.attention' (Attention)"),
        (
            ["--parallel.tp", "2", "--lora.dropout", "0.1"],
            "lora.dropout=0.1 with parallel.tp=2 is not supported yet",
        ),
        (["--quantize.linear", "mxfp8"], "lora.rank=4 with quantize.linear='mxfp8'"),
    ],
)
def test_unusable_lora_jobs_fail_before_anything_is_built(tmp_path, argv, message):
    cfg = _cfg(str(tmp_path), "bad", *argv)
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolve(cfg, world_size=2 if "--parallel.tp" in argv else 1)
    assert not (tmp_path / "bad").exists()


def _count_formula(model: torch.nn.Module, rank: int) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, titan_models.LoRALinear):
            total += rank * (m.in_features + m.out_features)
        elif isinstance(m, titan_models.LoRAGroupedExperts):  # gate, up: D -> H; down: H -> D
            total += 3 * m.num_experts * rank * (m.dim + m.hidden_dim)
    return total


@pytest.mark.parametrize(("argv", "adapted"), [([], 28), (MOE, 10)])
def test_trainable_parameters_follow_the_formula_and_optimizer_state_is_small(
    tmp_path, argv, adapted
):
    """r·(in + out) per linear and E·r·(in + out) per expert projection train; AdamW's state
    (bytes of every state tensor after a step) follows, measured against full fine-tuning of
    the same model: at most 5 % for the dense model at r=4. (The MoE debug flavour's experts
    are 64 wide, so r=4 adapters are 9 % of them: its ratio is printed and checked against
    the parameter counts only.)"""
    state_bytes, numel = {}, {}
    for lora in ("4", "0"):
        cfg = _cfg(str(tmp_path), "count", *argv, "--lora.rank", lora)
        model = build_model(resolve(cfg), torch.device("cpu"))
        pm = ParallelModel(parts=[model], dims=ParallelDims.resolve(cfg, 1))
        numel[lora] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if lora != "0":
            kinds = (titan_models.LoRALinear, titan_models.LoRAGroupedExperts)
            assert sum(isinstance(m, kinds) for m in model.modules()) == adapted
            assert numel[lora] == _count_formula(model, 4) > 0
            assert local_bytes(pm, optimizer="adamw", bf16=False)["optimizer"] == 8 * numel[lora]
        optimizer = build_optimizer(pm, cfg)
        model(TOKENS).float().mean().backward()
        optimizer.step()
        state_bytes[lora] = sum(
            t.numel() * t.element_size()
            for s in optimizer.state.values()
            for t in s.values()
            if isinstance(t, torch.Tensor) and t.dim()  # the moments, not the step counters
        )
        assert state_bytes[lora] == 8 * numel[lora]  # two fp32 moments per trained element
    ratio = state_bytes["4"] / state_bytes["0"]
    family = "qwen3_moe" if argv else "llama3"
    print(f"{family} optimizer state bytes, LoRA r=4 vs full: {state_bytes} -> {ratio:.4f}")
    if family == "llama3":
        assert ratio <= 0.05


def _checkpoint_tensors(run_dir: Path, step: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of the step's checkpoint files, by item (``model``, ``optim``, ...)."""
    from safetensors.torch import load_file

    (folder,) = glob.glob(f"{run_dir}/checkpoints/step-{step:012d}.*")
    out: dict[str, dict[str, torch.Tensor]] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        out.setdefault(path.name.split("-")[0], {}).update(load_file(path))
    return out


def _whole(
    pieces: dict[str, torch.Tensor], shapes: dict[str, list[int]]
) -> dict[str, torch.Tensor]:
    """Checkpointed pieces (``fqn@offset``) put back together."""
    out = {k: torch.full(shape, float("nan")) for k, shape in shapes.items()}
    for key, t in pieces.items():
        fqn, _, offset = key.partition("@")
        box = tuple(
            slice(int(o), int(o) + n) for o, n in zip(offset.split(","), t.shape, strict=True)
        )
        out[fqn][box] = t
    return out


def _adapters_in_checkpoint(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    (folder,) = glob.glob(f"{run_dir}/checkpoints/step-{step:012d}.*")
    manifest = json.loads((Path(folder) / "manifest.json").read_text())["body"]["items"]["model"]
    shapes = {k: v[2] for k, v in manifest["entries"].items()}
    return _whole(_checkpoint_tensors(run_dir, step)["model"], shapes)


def _assert_adapters_only(run_dir: Path, model: torch.nn.Module, step: int = STEPS) -> None:
    base = {n for n, _ in model.named_parameters() if not titan_models.is_lora_param(n)}
    lora = {n for n, _ in model.named_parameters() if titan_models.is_lora_param(n)}
    files = _checkpoint_tensors(run_dir, step)
    saved = {k.partition("@")[0] for k in files["model"]}  # pieces are saved as fqn@offset
    assert lora <= saved, sorted(lora - saved)[:3]
    for item, tensors in files.items():
        names = {k.partition("@")[0] for k in tensors}
        assert not base & names, (item, sorted(base & names)[:3])


def test_one_process_adapter_only_checkpoints_resume_bitwise_and_export_merged(tmp_path):
    out, short = str(tmp_path), ["--training.steps", "4", "--checkpoint.interval", "2"]
    full = train(_cfg(out, "full", *short, "--checkpoint.export-hf"))
    _assert_adapters_only(tmp_path / "full", full["model"], step=4)
    with torch.no_grad():  # the export merges W + s·B·A: a plain model transformers loads
        want = full["model"](TOKENS)
    diff = (_hf_logits(tmp_path / "full" / "hf") - want).abs().max().item()
    print(f"max |transformers logits of the merged export - adapted model| = {diff:.2e}")
    assert diff <= 1e-5
    first = train(_cfg(out, "resumed", *short), stop_after=3)["losses"]
    resumed = train(_cfg(out, "resumed", *short))
    assert first == full["losses"][:3]
    assert resumed["losses"] == full["losses"][2:]  # resumed from step 2: steps 3-4 again, bitwise
    assert full["losses"][-1] < full["losses"][0] - 0.3
    # The base is rebuilt from the config (training.seed): the models agree bitwise.
    got, want = dict(resumed["model"].named_parameters()), dict(full["model"].named_parameters())
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    # The run's config names the base the adapters belong to.
    config = json.loads((tmp_path / "full" / "config.json").read_text())
    assert (config["model"]["family"], config["training"]["seed"]) == ("llama3", 0)
    assert config["lora"]["rank"] == 4 and config["checkpoint"]["init_from_hf"] == ""


def test_lora_on_an_hf_base_trains_the_adapters_and_pins_that_base(tmp_path):
    out = str(tmp_path)
    base = build_model(resolve(_cfg(out, "base", "--lora.rank", "0")), torch.device("cpu"))
    titan_models.to_hf(base, tmp_path / "base_hf")
    argv = ["--checkpoint.init-from-hf", str(tmp_path / "base_hf"), "--training.steps", "3"]
    result = train(_cfg(out, "on_hf", *argv))
    trained = dict(result["model"].named_parameters())
    for name, value in base.named_parameters():  # the base as read from HF, frozen
        assert torch.equal(trained[name], value), name
    b = trained["layers.0.attention.wq.lora_b"]
    assert b.abs().max() > 0  # zero at the start, trained since
    # The adapters of a step-3 checkpoint belong to that base: another one is refused.
    shutil.copytree(tmp_path / "base_hf", tmp_path / "other_hf")
    other = [argv[0], str(tmp_path / "other_hf"), "--training.steps", "6"]
    with pytest.raises(ConfigError, match=r"checkpoint\.init_from_hf.*cannot change"):
        train(_cfg(out, "on_hf", *other, "--allow-config-change"))


# --- two processes against one --------------------------------------------------------------


def _lora_cases(out: str) -> dict[str, list[float]]:
    """Runs on both ranks: each layout, and a data-parallel resume after a stop at step 4."""
    got = {name: train(_cfg(out, name, *argv))["losses"] for name, argv in WORLD2.items()}
    argv = WORLD2["dp2"][:-1]
    got["resumed"] = train(_cfg(out, "resumed", *argv), stop_after=4)["losses"]
    got["resumed"] += train(_cfg(out, "resumed", *argv))["losses"]
    return got


def _reference(out: str, name: str, dp: int, *argv: str):
    """One process training on the ``dp`` ranks' batches of every step concatenated (the
    global batch a data-parallel job reads); returns its losses and model."""
    cfg = _cfg(out, name, *argv)
    job = resolve(cfg)
    model = build_model(job, torch.device("cpu"))
    pm = ParallelModel(parts=[model], dims=ParallelDims.resolve(cfg, 1))
    optimizer = build_optimizer(pm, cfg)
    scheduler = build_lr_scheduler(optimizer, STEPS, cfg.lr_schedule)
    loaders = [job_loaders(cfg, job.tokenizer, dp_rank=r, dp_size=dp)[0] for r in range(dp)]
    losses = []
    for _ in range(STEPS):
        parts = [next(loader) for loader in loaders]
        batch = Batch(
            *(torch.cat([getattr(b, f) for b in parts], dim=-2) for f in ("input_ids", "labels")),
            torch.cat([b.document_ids for b in parts]),
            torch.cat([b.positions for b in parts], dim=-2),
        )
        losses.append(float(train_step(pm, optimizer, batch, cfg).loss))
        scheduler.step()
    return losses, model


def _hf_logits(path: Path) -> torch.Tensor:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model(TOKENS).logits


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    got = run_distributed(_lora_cases, 2, str(out / "w2"), timeout=600)[0]
    got["dp2_reference"] = _reference(str(out), "ref", 2)
    got["pp2_reference"] = _reference(str(out), "ref_pp", 1)
    got["moe_reference"] = _reference(str(out), "ref_moe", 2, *MOE)
    got["out"] = out / "w2"
    return got


def _max_diff(a, b) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.slow  # one spawn of 2 ranks (5 trainings) and 3 one-process references, ~80 s
def test_data_tensor_and_pipeline_parallel_lora_train_like_one_process(runs):
    for name, ref in (
        ("dp2", "dp2_reference"),
        ("pp2", "pp2_reference"),
        ("tp2", "pp2_reference"),
        ("moe_ep2", "moe_reference"),
    ):
        losses, model = runs[ref]
        print(f"{name}: max |loss - one process| = {_max_diff(runs[name], losses):.2e}")
        torch.testing.assert_close(runs[name], losses, rtol=0, atol=1e-5)
        assert runs[name][-1] < runs[name][0] - 0.3, runs[name]
    # The checkpoints hold the adapters and no base weight (a per-rank item under EP).
    _assert_adapters_only(runs["out"] / "moe_ep2", runs["moe_reference"][1])
    # The trained adapters (the sharded checkpoint's pieces put together) equal one process's;
    # the MoE's are checked through its merged export (test_merged_export_...).
    for name, ref in (("dp2", "dp2_reference"),):
        model = runs[ref][1]
        adapters = _adapters_in_checkpoint(runs["out"] / name, STEPS)
        lora = {n: p for n, p in model.named_parameters() if titan_models.is_lora_param(n)}
        assert lora.keys() <= adapters.keys()
        diff = max((adapters[n] - p.detach()).abs().max().item() for n, p in lora.items())
        print(f"{name}: max |adapter - one process| = {diff:.2e}")
        assert diff <= 1e-5
        _assert_adapters_only(runs["out"] / name, model)


@pytest.mark.slow
def test_data_parallel_resume_from_adapter_only_checkpoints_continues_bitwise(runs):
    full, resumed = runs["dp2"], runs["resumed"]
    assert len(resumed) == 4 + 3
    assert resumed[:4] == full[:4]
    assert resumed[4:] == full[3:]


@pytest.mark.slow
def test_merged_export_loads_in_transformers_with_the_adapted_model_logits(runs):
    for name, ref in (
        ("dp2", "dp2_reference"),
        ("tp2", "pp2_reference"),
        ("moe_ep2", "moe_reference"),
    ):
        model = runs[ref][1]
        with torch.no_grad():
            want = model(TOKENS)
        got = _hf_logits(runs["out"] / name / "hf")
        diff = (got - want).abs().max().item()
        print(f"{name}: max |transformers logits of the export - adapted model| = {diff:.2e}")
        assert diff <= 1e-5
