"""End-to-end training on one process: loss falls, outputs exist, exact resume, HF export."""

from __future__ import annotations

import json
import os

import pytest
import torch

from titan_train.cli import main, parse_config
from titan_train.trainer import train


def _cfg(tmp_path, *extra: str):
    return parse_config(
        [
            "--output-dir", str(tmp_path), "--name", "t",
            "--training.steps", "20", "--training.batch-size", "4", "--training.seq-len", "64",
            "--lr-schedule.warmup-steps", "2", "--metrics.log-every", "5",
            "--metrics.validate-every", "10", "--metrics.validation-batches", "1",
            "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0",
            *extra,
        ]
    )  # fmt: skip


def test_debug_model_learns_and_writes_its_run_folder(tmp_path):
    out = train(_cfg(tmp_path, "--training.grad-accum", "2"))
    losses = out["losses"]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < 0.6 * sum(losses[:3]) / 3, losses
    run = tmp_path / "t"
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines if x["split"] == "train"] == [5, 10, 15, 20]
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "mfu"} <= set(lines[0])
    assert any(x["split"] == "validation" for x in lines)
    assert (run / "loss.png").stat().st_size > 0
    assert any(f.name.startswith("events.out.tfevents") for f in (run / "tensorboard").iterdir())
    assert json.loads((run / "config.json").read_text())["training"]["steps"] == 20


def test_grad_accumulation_gives_the_same_step_as_one_big_batch(tmp_path):
    one = train(_cfg(tmp_path / "a", "--training.steps", "3"))["losses"]
    two = train(_cfg(tmp_path / "b", "--training.steps", "3", "--training.grad-accum", "4"))
    assert torch.allclose(torch.tensor(one), torch.tensor(two["losses"]), rtol=0, atol=1e-5)


def test_resume_after_a_stop_continues_bitwise(tmp_path):
    ckpt = ["--checkpoint.interval", "5", "--checkpoint.async-mode", "thread"]
    full = train(_cfg(tmp_path / "full", *ckpt))["losses"]
    first = train(_cfg(tmp_path / "resumed", *ckpt), stop_after=12)
    assert first["losses"] == full[:12]
    # A new process would start here: everything comes back from the step-10 checkpoint.
    rest = train(_cfg(tmp_path / "resumed", *ckpt))
    assert rest["losses"] == full[10:], "steps 11-20 after resuming from step 10"


def test_hf_export_loads_in_transformers_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    out = train(_cfg(tmp_path, "--training.steps", "10", "--checkpoint.export-hf"))
    hf_dir = out["run_dir"] / "hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    tokens = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        ours = out["model"](tokens)
        theirs = hf(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parallel.tp", "2"], "must equal the world size 1"),
        (["--data.tokenizer", "/nonexistent/tokenizer.json"], "no such tokenizer.json"),
        (["--model.flavor", "huge"], "unknown flavor 'huge'"),
        (["--data.source", "files", "--data.paths", "/nonexistent.jsonl"], "does not exist"),
    ],
)
def test_bad_input_is_one_error_line_and_writes_nothing(tmp_path, capsys, argv, message):
    rc = main(["--output-dir", str(tmp_path), "--training.steps", "1", *argv])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("world", "argv", "message"),
    [
        ("2", ["--parallel.tp", "3"], "must equal the world size 2"),
        ("3", ["--parallel.tp", "3"], "parallel.tp=3 must divide the model's num_heads=8"),
        ("8", ["--parallel.pp", "8"], "needs 8 stages but the model has only 6 pipeline units"),
        ("2", ["--parallel.pp", "2", "--parallel.pp-schedule", "nope"], "pp_schedule='nope'"),
        ("2", ["--parallel.ep", "2"], "has no MoE layers"),
        ("2", ["--parallel.cp", "2", "--remat.policy", "selective"], "does not compose with remat"),
    ],
)
def test_bad_parallel_layout_is_rejected_before_joining_a_process_group(
    tmp_path, capsys, monkeypatch, world, argv, message
):
    monkeypatch.setenv("WORLD_SIZE", world)  # as under torchrun; no group may be formed
    rc = main(["--output-dir", str(tmp_path), "--training.steps", "1", *argv])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_of_another_model_is_one_error_line_and_nothing_is_written(tmp_path, capsys):
    common = ["--output-dir", str(tmp_path), "--name", "run", "--training.steps", "2",
              "--checkpoint.interval", "2", "--metrics.validate-every", "0",
              "--metrics.no-tensorboard", "--metrics.peak-flops", "1e11"]  # fmt: skip
    assert main([*common, "--recipe", "qwen3_debug"]) == 0
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")}
    config = (tmp_path / "run" / "config.json").read_text()
    capsys.readouterr()
    assert main([*common, "--recipe", "llama3_debug"]) == 2
    err = capsys.readouterr().err.strip()
    assert "resuming" in err and "from step 2" in err and "model.family: 'qwen3' saved" in err
    assert "model.family" in err.split("):")[-1] and "cannot change within a run" in err, err
    assert len(err.splitlines()) == 1, err
    assert (tmp_path / "run" / "config.json").read_text() == config
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "run").rglob("*")} == before


@pytest.mark.parametrize(
    "recipe",
    [
        "qwen3_moe_debug",
        pytest.param("gpt_oss_debug", marks=pytest.mark.slow),  # 35-95 s (shared CPU)
        pytest.param("deepseek_v4_debug", marks=pytest.mark.slow),  # 80-95 s (shared CPU)
    ],
)
def test_moe_recipe_logs_expert_load_and_learns(tmp_path, recipe):
    cfg = parse_config(
        ["--output-dir", str(tmp_path), "--training.steps", "6", "--metrics.log-every", "3",
         "--metrics.validate-every", "0", "--metrics.no-tensorboard",
         "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0"],
        recipe,
    )  # fmt: skip
    out = train(cfg)
    rows = [json.loads(x) for x in (out["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert all(r["moe_load_max"] >= r["moe_load_mean"] >= 1.0 for r in rows)
    assert out["losses"][-1] < out["losses"][0]


def test_attention_backend_reaches_the_model_and_backends_train_alike(tmp_path):
    from titan_train.build import build_model, resolve

    dense = _cfg(tmp_path / "a", "--training.steps", "3", "--model.attention-backend", "sdpa")
    model = build_model(resolve(dense), torch.device("cpu"))
    assert model.config.attention_backend == "sdpa"
    # Packed rows of many short documents: the dense mask vs varlen's tiles.
    a = train(dense)["losses"]
    b = train(_cfg(tmp_path / "b", "--training.steps", "3", "--model.attention-backend", "varlen"))
    assert torch.allclose(torch.tensor(a), torch.tensor(b["losses"]), rtol=0, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["qwen3_5_moe_debug", "kimi_linear_debug"])
def test_linear_attention_hybrid_recipe_learns(tmp_path, recipe):
    # Packed documents (the built-in corpus) through the chunked delta rule and the MoE.
    cfg = parse_config(
        ["--output-dir", str(tmp_path), "--training.steps", "8", "--metrics.log-every", "4",
         "--metrics.validate-every", "0", "--metrics.no-tensorboard",
         "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0"],
        recipe,
    )  # fmt: skip
    losses = train(cfg)["losses"]
    assert sum(losses[-2:]) / 2 < 0.9 * sum(losses[:2]) / 2, losses
