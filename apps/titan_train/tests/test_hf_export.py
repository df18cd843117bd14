"""The app's HF export of gpt-oss (experts fused as ``gate_up_proj`` in HF's files, so each
rank's expert pieces go through the stacked-parts layout of ``titan_models.hf_export``): on one
process and at EP 2, tied and untied heads, transformers loads the folder and computes the
trained model's logits. And an export that fails loses nothing: the last checkpoint is written
first, the error names it, and a rerun of the same command exports from it."""

from __future__ import annotations

import os

import pytest
import torch

import titan_models
from titan_testing import run_distributed
from titan_train.cli import parse_config
from titan_train.data.tokenizers import build_tokenizer
from titan_train.errors import ExportError
from titan_train.trainer import train

transformers = pytest.importorskip("transformers")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

COMMON = [
    "--training.steps", "2", "--training.batch-size", "4", "--training.seq-len", "32",
    "--metrics.validate-every", "0", "--metrics.no-tensorboard", "--metrics.peak-flops", "1e11",
    "--checkpoint.export-hf",
]  # fmt: skip
TOKENS = torch.arange(64).reshape(2, 32) * 7 % 256


def _tied_gpt_oss_folder(path: str) -> str:
    """A small gpt-oss with a tied head as an HF folder (the app starts from it)."""
    cls, config = titan_models.get_model(
        "gpt_oss", "debug", num_layers=2, sliding_window_layers=(0,), tie_embeddings=True,
        vocab_size=build_tokenizer("byte").vocab_size,
    )  # fmt: skip
    with torch.device("meta"):
        model = cls(config)
    model.init_weights(device="cpu", seed=5)
    return str(titan_models.to_hf(model, path))


def _cases(tmp: str) -> dict[str, list[str]]:
    return {
        "untied": [],  # the recipe's own model
        "tied": ["--checkpoint.init-from-hf", f"{tmp}/tied_src"],
    }


def _train_and_logits(out: str, tmp: str, *layout: str) -> dict[str, torch.Tensor]:
    """Every case trained (on every rank) and its trained model's logits on ``TOKENS``."""
    logits = {}
    for name, argv in _cases(tmp).items():
        cfg = parse_config(
            ["--output-dir", out, "--name", name, *COMMON, *argv, *layout], "gpt_oss_debug"
        )
        model = train(cfg)["model"]
        with torch.no_grad():
            logits[name] = model.eval()(TOKENS)
    return logits


def _hf_logits(path: str) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    )
    with torch.no_grad():
        return hf(TOKENS).logits


def test_gpt_oss_export_on_one_process_and_at_ep2_gives_the_trained_logits(tmp_path):
    # Guards: the export of gpt-oss crashed ("gate_up_proj fuses several of our tensors")
    # since the app passes each rank's pieces, and a tied head must come back tied.
    tmp = str(tmp_path)
    _tied_gpt_oss_folder(f"{tmp}/tied_src")
    one = _train_and_logits(f"{tmp}/one", tmp)
    ep2 = run_distributed(
        _train_and_logits, 2, f"{tmp}/ep2", tmp, "--parallel.dp-shard", "2", "--parallel.ep", "2",
        timeout=600,
    )[0]  # fmt: skip
    for name in _cases(tmp):
        for where, ours in (("one", one[name]), ("ep2", ep2[name])):
            theirs = _hf_logits(f"{tmp}/{where}/{name}/hf")
            diff = (ours - theirs).abs().max().item()
            assert diff <= 1e-4, f"{where}/{name}: transformers' logits differ by {diff}"
    config = (tmp_path / "one" / "tied" / "hf" / "config.json").read_text()
    assert '"tie_word_embeddings": true' in config


def test_a_failed_export_names_the_checkpoint_and_a_rerun_exports_from_it(tmp_path, monkeypatch):
    # Guards: an export error used to end the run with the trained weights nowhere on disk.
    import titan_train.checkpointing as checkpointing

    argv = ["--output-dir", str(tmp_path), "--name", "x", *COMMON, "--checkpoint.interval", "0"]
    real = checkpointing.write_hf

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpointing, "write_hf", broken)
    with pytest.raises(ExportError, match=r"No space left.*safe in the step-2 checkpoint in"):
        train(parse_config(argv))
    assert not (tmp_path / "x" / "hf" / "config.json").exists()
    monkeypatch.setattr(checkpointing, "write_hf", real)
    # The error's advice: the same command with checkpoints on (interval 0 wrote none).
    again = train(parse_config([*argv, "--checkpoint.interval", "2", "--allow-config-change"]))
    assert again["step"] == 2 and again["losses"] == []  # nothing trained again
    with torch.no_grad():
        ours = again["model"](TOKENS)
    assert (ours - _hf_logits(str(tmp_path / "x" / "hf"))).abs().max().item() <= 1e-4
