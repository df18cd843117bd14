"""The registry names every family and flavour and refuses unknown ones with the list."""

from __future__ import annotations

import pytest
import torch

import titan_models


def test_list_models_names_every_family_and_all_flavors():
    assert titan_models.list_models() == {
        "llama3": ["debug", "1B", "3B", "8B", "70B", "405B"],
        "qwen3": ["debug", "0.6B", "1.7B", "4B", "8B", "14B", "32B"],
        "qwen3_moe": ["debug", "30B-A3B", "235B-A22B"],
        "deepseek_v3": ["debug", "16B", "671B"],
        "gpt_oss": ["debug", "20B", "120B"],
        "deepseek_v4": ["debug", "flash", "pro"],
        "qwen3_5": ["debug", "27B"],
        "qwen3_5_moe": ["debug", "35B-A3B"],
        "kimi_linear": ["debug", "48B-A3B"],
        "qwen3_vl": ["debug", "2B", "4B", "8B", "32B"],
        "qwen3_vl_moe": ["debug", "30B-A3B", "235B-A22B"],
        "kimi_k25": ["debug", "1T"],
        "muse_glimmer": ["debug", "30B"],
        "muse_spark": ["debug", "816B"],
    }


def test_get_model_returns_class_and_config_with_overrides():
    cls, config = titan_models.get_model("qwen3", "8B", num_layers=2)
    assert cls is titan_models.Qwen3
    assert isinstance(config, titan_models.Qwen3Config)
    assert (config.num_layers, config.dim, config.vocab_size) == (2, 4096, 151_936)
    assert titan_models.get_model("qwen3", "8B")[1].num_layers == 36  # flavours are not mutated


def test_unknown_family_lists_the_known_ones():
    with pytest.raises(
        ValueError,
        match=r"unknown model family 'gpt2'; known: \['llama3', 'qwen3', 'qwen3_moe', "
        r"'deepseek_v3', 'gpt_oss', 'deepseek_v4', 'qwen3_5', 'qwen3_5_moe', 'kimi_linear', "
        r"'qwen3_vl', 'qwen3_vl_moe', 'kimi_k25', 'muse_glimmer', 'muse_spark'\]",
    ):
        titan_models.get_model("gpt2", "debug")


def test_unknown_flavor_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown flavor '7B'.*'debug', '1B', '3B', '8B'"):
        titan_models.get_model("llama3", "7B")


def test_unknown_override_lists_the_fields():
    with pytest.raises(
        ValueError, match=r"unknown Llama3Config field\(s\) \['n_layers'\].*num_layers"
    ):
        titan_models.get_model("llama3", "debug", n_layers=2)


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ({"num_kv_heads": 3}, "num_heads=8 must be a multiple of num_kv_heads=3"),
        ({"dim": 0}, r"Llama3Config.dim must be an int >= 1, got 0"),
        ({"head_dim": 31}, "head_dim must be even"),
        ({"norm_eps": 0.0}, "norm_eps must be > 0"),
    ],
)
def test_invalid_config_values_name_the_field(override, match):
    with pytest.raises(ValueError, match=match):
        titan_models.get_model("llama3", "debug", **override)


def test_flavor_hyperparameters_match_the_hf_configs():
    llama8 = titan_models.get_model("llama3", "8B")[1]
    assert (llama8.vocab_size, llama8.rope.theta, llama8.rope.scaling.factor) == (
        128_256,
        500_000.0,
        8.0,
    )
    assert (llama8.norm_eps, llama8.max_seq_len, llama8.tie_embeddings) == (1e-5, 131_072, False)
    llama1 = titan_models.get_model("llama3", "1B")[1]
    assert (llama1.rope.scaling.factor, llama1.tie_embeddings) == (32.0, True)  # Llama 3.2
    for flavor in ("0.6B", "1.7B", "4B", "8B", "14B", "32B"):
        q = titan_models.get_model("qwen3", flavor)[1]
        assert (q.vocab_size, q.head_dim, q.rope.theta, q.rope.scaling) == (151_936, 128, 1e6, None)
        assert q.tie_embeddings == (flavor in ("0.6B", "1.7B", "4B"))
        assert q.norm_eps == 1e-6


def test_debug_flavor_builds_and_runs_on_cpu():
    cls, config = titan_models.get_model("llama3", "debug")
    logits = cls(config)(torch.zeros(2, 8, dtype=torch.long))
    assert logits.shape == (2, 8, config.vocab_size)


def test_replace_config_sets_dotted_fields_validated_by_the_config_classes():
    _, config = titan_models.get_model("llama3", "debug")
    fields = titan_models.config_field_types(config)
    assert fields["max_seq_len"] is int and fields["rope.theta"] is float
    new = titan_models.replace_config(config, {"max_seq_len": 16384, "rope.theta": 1e6})
    assert (new.max_seq_len, new.rope.theta) == (16384, 1e6)
    assert (config.max_seq_len, config.rope.theta) == (2048, 500000.0)  # untouched
    assert new.rope.scaling == config.rope.scaling  # siblings of a nested change are kept
    with pytest.raises(ValueError, match=r"unknown Llama3Config field\(s\) \['rope_theta'\]"):
        titan_models.replace_config(config, {"rope_theta": 1e6})
    with pytest.raises(ValueError, match=r"RopeConfig.theta must be > 0, got -1"):
        titan_models.replace_config(config, {"rope.theta": -1})
    with pytest.raises(ValueError, match=r"num_heads=4 must be a multiple of num_kv_heads=3"):
        titan_models.replace_config(config, {"num_heads": 4, "num_kv_heads": 3})
    plain = titan_models.replace_config(config, {"rope.scaling": None})  # optional: turn off
    assert plain.rope.scaling is None and plain.rope.theta == config.rope.theta
    assert "theta" not in fields and "rope" not in fields  # a required nested config: leaves only
    with pytest.raises(ValueError, match=r"\['rope.scaling'\] set together with fields inside"):
        titan_models.replace_config(config, {"rope.scaling": None, "rope.scaling.factor": 2.0})


def test_from_hf_with_config_changes(tmp_path):
    model_cls, config = titan_models.get_model("llama3", "debug", vocab_size=256)
    with torch.device("meta"):
        model = model_cls(config)
    model.init_weights(device="cpu", seed=0)
    path = titan_models.to_hf(model, tmp_path / "hf")
    longer = titan_models.from_hf(path, config_changes={"max_seq_len": 8192})
    assert longer.config.max_seq_len == 8192
    assert torch.equal(longer.tok_embeddings.weight, model.tok_embeddings.weight)
    with pytest.raises(ValueError, match="shape"):  # a change of a weight's shape
        titan_models.from_hf(path, config_changes={"ffn_hidden_dim": 64})
