"""Bad HF input gets an error naming the field or key; nothing half-loaded or half-written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import titan_models


def _edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is KeyError:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


def _edit_tensors(folder, edit):
    path = folder / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        (
            "llama3",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"rope_parameters.rope_type='dynamic' is not supported",
        ),
        (
            "llama3",
            {"rope_parameters": None, "rope_scaling": {"type": "longrope", "factor": 2.0}},
            r"rope_scaling.rope_type='longrope' is not supported",
        ),
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 0,
                "layer_types": ["sliding_attention"] * 2,
            },
            r"Qwen3Config.sliding_window must be an int >= 1",
        ),
        ("llama3", {"sliding_window": 4096}, r"sliding_window=4096"),
        (
            "qwen3",
            {
                "use_sliding_window": True,
                "sliding_window": 8,
                "layer_types": ["full_attention", "chunked_attention"],
            },
            r"layer_types contains \['chunked_attention'\]",
        ),
        ("mistral", {"layer_types": ["sliding_attention"] * 2}, r"layer_types=.* for mistral"),
        ("llama3", {"attention_bias": True}, r"attention_bias=True"),
        ("llama3", {"mlp_bias": True}, r"mlp_bias=True"),
        ("qwen3", {"hidden_act": "gelu"}, r"hidden_act='gelu'"),
        ("llama3", {"quantization_config": {"quant_method": "fp8"}}, r"quantization_config"),
        ("llama3", {"model_type": "mixtral"}, r"model_type='mixtral' is not supported"),
        ("qwen3", {"hidden_size": KeyError}, r"hidden_size is missing"),
    ],
)
def test_unsupported_hf_config_names_the_field(hf_checkpoint, family, changes, match):
    _, folder = hf_checkpoint(family)
    _edit_config(folder, **changes)
    with pytest.raises(ValueError, match=match):
        titan_models.from_hf(folder)


def test_missing_and_unexpected_keys_are_all_named(hf_checkpoint):
    _, folder = hf_checkpoint("llama3")

    def edit(t):
        del t["model.layers.1.mlp.up_proj.weight"]
        t["model.layers.1.mlp.extra.weight"] = torch.zeros(2)

    _edit_tensors(folder, edit)
    with pytest.raises(ValueError) as info:
        titan_models.from_hf(folder)
    message = str(info.value)
    assert "1 missing keys: model.layers.1.mlp.up_proj.weight" in message
    assert "1 unexpected keys: model.layers.1.mlp.extra.weight" in message


def test_a_missing_expert_and_a_ninth_expert_are_named(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3_moe")  # 8 experts

    def edit(t):
        del t["model.layers.1.mlp.experts.3.up_proj.weight"]
        t["model.layers.1.mlp.experts.8.up_proj.weight"] = torch.zeros(32, 64)

    _edit_tensors(folder, edit)
    with pytest.raises(ValueError) as info:
        titan_models.from_hf(folder)
    message = str(info.value)
    assert "1 missing keys: model.layers.1.mlp.experts.3.up_proj.weight" in message
    assert "1 unexpected keys: model.layers.1.mlp.experts.8.up_proj.weight" in message


def test_wrong_shape_names_the_key_and_both_shapes(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3")
    _edit_tensors(
        folder, lambda t: t.update({"model.layers.0.self_attn.k_norm.weight": torch.ones(16)})
    )
    with pytest.raises(
        ValueError,
        match=r"model.layers.0.self_attn.k_norm.weight: checkpoint shape \(16,\), model shape \(32,\)",
    ):
        titan_models.from_hf(folder)


def test_integer_tensor_is_refused(hf_checkpoint):
    _, folder = hf_checkpoint("llama3")
    _edit_tensors(
        folder, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int32)})
    )
    with pytest.raises(ValueError, match=r"model.norm.weight: dtype I32 is not a floating dtype"):
        titan_models.from_hf(folder, dtype=torch.float32)


def test_mixed_dtype_without_dtype_argument_is_refused(hf_checkpoint):
    _, folder = hf_checkpoint("llama3")
    _edit_tensors(folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].half()}))
    with pytest.raises(
        ValueError, match=r"model.norm.weight: dtype torch.float16, checkpoint dtype torch.float32"
    ):
        titan_models.from_hf(folder)
    model = titan_models.from_hf(folder, dtype=torch.float32)  # explicit conversion is fine
    assert model.norm.weight.dtype == torch.float32


def test_tied_checkpoint_with_a_stored_lm_head_is_accepted(hf_checkpoint):
    _, folder = hf_checkpoint("qwen3", tie_word_embeddings=True)
    _edit_tensors(
        folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()})
    )
    model = titan_models.from_hf(folder)
    assert model.output.weight is model.tok_embeddings.weight


def test_folder_without_config_or_weights(tmp_path, hf_checkpoint):
    with pytest.raises(FileNotFoundError, match="config.json"):
        titan_models.from_hf(tmp_path)
    _, folder = hf_checkpoint("llama3")
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        titan_models.from_hf(folder)


def test_broken_config_truncated_weights_and_escaping_index_name_the_file(hf_checkpoint):
    _, folder = hf_checkpoint("llama3")
    config = folder / "config.json"
    good = config.read_text()
    config.write_text(good[: len(good) // 2])
    with pytest.raises(ValueError, match=rf"{config} is not a readable JSON file"):
        titan_models.from_hf(folder)
    config.write_text(good)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=rf"{weights} is not a readable safetensors file"):
        titan_models.from_hf(folder)
    weights.write_bytes(data)
    secret = folder.parent / "outside.safetensors"
    secret.write_bytes(data)
    index = folder / "model.safetensors.index.json"
    for name in ("../outside.safetensors", str(secret)):
        keys = load_file(weights).keys()
        index.write_text(json.dumps({"weight_map": dict.fromkeys(keys, name)}))
        with pytest.raises(ValueError, match=r"is outside the checkpoint folder"):
            titan_models.from_hf(folder)


def test_to_hf_refuses_a_non_empty_folder(tmp_path):
    cls, config = titan_models.get_model("llama3", "debug", num_layers=1)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="not an empty folder"):
        titan_models.to_hf(cls(config), tmp_path / "out")


def test_to_hf_refuses_a_partial_or_meta_model(tmp_path):
    cls, config = titan_models.get_model("llama3", "debug", num_layers=2)
    stage = cls(config)
    stage.output = None  # a pipeline stage without the head
    with pytest.raises(ValueError, match="needs the whole model.*output.weight"):
        titan_models.to_hf(stage, tmp_path / "a")
    with torch.device("meta"):
        meta = cls(config)
    with pytest.raises(ValueError, match="gather it first"):
        titan_models.to_hf(meta, tmp_path / "b")
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    """to_hf writes through torch_checkpointing.save_hf: a shard that fails to write leaves no
    folder (it was new), so nothing half-written loads and the call can be run again."""
    from torch_checkpointing import FileSystemStorage

    cls, config = titan_models.get_model("llama3", "debug", num_layers=2)
    model = cls(config)
    calls = []
    real = FileSystemStorage.write

    def failing_write(self, name, chunks):
        calls.append(name)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(self, name, chunks)

    monkeypatch.setattr(FileSystemStorage, "write", failing_write)
    with pytest.raises(OSError, match="disk full"):
        titan_models.to_hf(model, tmp_path / "ckpt", max_shard_size="1MB")
    assert len(calls) == 2
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(FileSystemStorage, "write", real)
    titan_models.to_hf(model, tmp_path / "ckpt", max_shard_size="1MB")  # again: it works
    assert (tmp_path / "ckpt" / "config.json").is_file()
