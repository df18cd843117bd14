"""``--model.config field=value``: any field of the family's model config from the CLI, a
recipe or a config file, typed and validated (one error line naming the entry)."""

from __future__ import annotations

import pytest

from titan_train.cli import main, parse_config
from titan_train.trainer import train


def test_a_two_layer_128_wide_llama_trains_past_the_flavours_max_seq_len(tmp_path):
    seq = 16384  # the flavour's max_seq_len is 2048
    cfg = parse_config(
        [
            "--output-dir", str(tmp_path), "--name", "tiny",
            "--training.steps", "2", "--training.batch-size", "1", "--training.seq-len", str(seq),
            "--metrics.validation-batches", "0", "--checkpoint.interval", "0",
            "--model.config", "num_layers=2", "dim=128", f"max_seq_len={seq}", "rope.theta=1e6",
        ]
    )  # fmt: skip
    out = train(cfg)
    assert len(out["losses"]) == 2
    model = out["model"]
    assert len(model.layers) == 2 and model.config.dim == 128
    assert (model.config.max_seq_len, model.config.rope.theta) == (seq, 1e6)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("rope_theta=1e6", "model.config 'rope_theta' is not a field of Llama3Config; fields:"),
        ("num_layers=2.5", "model.config num_layers=2.5 must be an integer"),
        ("num_layers", "model.config entry 'num_layers' must read 'field=value'"),
        ("tie_embeddings=yes", "model.config tie_embeddings='yes' must be true or false"),
        ("num_layers=0", "Llama3Config.num_layers must be an int >= 1, got 0"),
        ("vocab_size=16", "has vocab_size=16, smaller than the tokenizer's"),
    ],
)
def test_a_bad_model_config_entry_is_one_error_line(entry, message, capsys, tmp_path):
    assert main(["--output-dir", str(tmp_path), "--model.config", entry]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err
    assert not any(tmp_path.iterdir()), "nothing written before the error"


def test_json_values_and_nulls_are_typed_by_the_field():
    cfg = parse_config(
        ["--model.config", "sliding_window=null", "sliding_window_layers=[0, 1]", "norm_eps=1e-6"]
    )
    import titan_models
    from titan_train.config_file import model_config_changes

    _, config = titan_models.get_model("llama3", "debug")
    changes = model_config_changes(config, cfg.model.config)
    assert changes == {"sliding_window": None, "sliding_window_layers": (0, 1), "norm_eps": 1e-6}
    off = parse_config(["--model.config", "rope.scaling=null", "rope.theta=10000"])
    changes = model_config_changes(config, off.model.config)
    assert changes == {"rope.scaling": None, "rope.theta": 10000.0}
    assert titan_models.replace_config(config, changes).rope.scaling is None


def test_a_run_builds_its_model_config_once(tmp_path, monkeypatch):
    """Resolved once (``titan_train.build.resolve``) and handed down: validation, checkpoints
    and the HF export of a 2-step run read that one config, never a rebuilt one."""
    import sys

    import titan_train.model_config as source

    real, calls = source.model_config, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for module in [m for name, m in sys.modules.items() if name.startswith("titan_train")]:
        if getattr(module, "model_config", None) is real:
            monkeypatch.setattr(module, "model_config", counted)
    argv = ["--output-dir", str(tmp_path), "--training.steps", "2", "--checkpoint.export-hf"]
    out = train(parse_config([*argv, "--metrics.validate-every", "1"]))
    assert len(out["losses"]) == 2 and (out["run_dir"] / "hf" / "config.json").is_file()
    assert len(calls) == 1
