"""HF-style sharded safetensors export and import (one process; 4 ranks in test_distributed)."""

from __future__ import annotations

import json
import sys
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from torch_checkpointing import FsspecStorage, StateMismatchError, load_hf, parse_size, save_hf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _checkpointing_cases import Chunked
from _faulty_storage import FaultyStorage


def _state():
    g = torch.Generator().manual_seed(1)
    return {
        "model.embed.weight": torch.randn(50, 16, generator=g),
        "model.layers.0.attn.q.weight": torch.randn(16, 16, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up.weight": torch.randn(32, 16, generator=g).half(),
        "model.norm.weight": torch.ones(16),
        "lm_head.weight": torch.randn(50, 16, generator=g),
        "model.step": torch.tensor(3, dtype=torch.int64),
    }


def test_sharded_export_is_hf_compatible(tmp_path):
    sd = _state()
    index = save_hf(sd, tmp_path, max_shard_size=4000)
    on_disk = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert on_disk == index
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    loaded = {}
    for f in files:
        part = load_file(str(tmp_path / f))  # the reference reader
        assert all(index["weight_map"][k] == f for k in part)
        loaded.update(part)
    assert sorted(loaded) == sorted(sd) and all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in sd.values())
    back = load_hf(tmp_path)
    assert list(back) == list(sd) and all(torch.equal(back[k], sd[k]) for k in sd)
    assert not list(tmp_path.glob(".tmp-*"))


def test_single_file_and_files_written_by_safetensors(tmp_path):
    sd = _state()
    save_hf(sd, tmp_path / "one")
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == ["model.safetensors"]
    back = load_hf(tmp_path / "one")
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    (tmp_path / "ref").mkdir()
    save_file(sd, str(tmp_path / "ref" / "model.safetensors"), metadata={"format": "pt"})
    target = {k: torch.zeros_like(v) for k, v in sd.items()}
    load_hf(tmp_path / "ref", target)
    assert all(torch.equal(target[k], sd[k]) for k in sd)


def test_in_place_into_chunks_and_mismatch(tmp_path):
    sd = _state()
    save_hf(sd, tmp_path, max_shard_size=2000)
    emb = sd["model.embed.weight"]
    chunked = Chunked(
        emb.shape, emb.dtype, [((10, 4), torch.zeros(20, 8)), ((45, 0), torch.zeros(5, 16))]
    )
    load_hf(tmp_path, {"model.embed.weight": chunked}, strict=False)
    assert torch.equal(chunked.local_chunks()[0][1], emb[10:30, 4:12])
    assert torch.equal(chunked.local_chunks()[1][1], emb[45:50])
    wrong = {k: torch.zeros_like(v) for k, v in sd.items()}
    wrong["lm_head.weight"] = torch.zeros(51, 16)
    wrong["extra"] = torch.zeros(1)
    del wrong["model.norm.weight"]
    snapshot = {k: v.clone() for k, v in wrong.items()}
    with pytest.raises(StateMismatchError) as info:
        load_hf(tmp_path, wrong)
    assert info.value.missing == ["extra"] and info.value.unexpected == ["model.norm.weight"]
    assert info.value.mismatched == [("lm_head.weight", "float32[51, 16]", "float32[50, 16]")]
    assert all(torch.equal(wrong[k], snapshot[k]) for k in wrong)


def test_fsspec_backend_and_bad_input(tmp_path):
    storage = FsspecStorage(f"memory://hf-{uuid.uuid4().hex}")
    sd = _state()
    save_hf(sd, "export", storage=storage, max_shard_size="3KB")
    back = load_hf("export", storage=storage)
    assert all(torch.equal(back[k], sd[k]) for k in sd)
    with pytest.raises(ValueError, match="max_shard_size"):
        save_hf(sd, tmp_path, max_shard_size="lots")
    with pytest.raises(TypeError, match="safetensors lacks"):
        save_hf({"x": torch.zeros(2, dtype=torch.complex128)}, tmp_path)
    with pytest.raises(FileNotFoundError):
        load_hf(tmp_path / "empty-dir")


def test_pieces_and_layout_transforms_are_written_as_whole_hf_tensors(tmp_path):
    sd = _state()
    emb, q = sd["model.embed.weight"], sd["model.layers.0.attn.q.weight"]
    pieces = dict(sd)
    pieces["model.embed.weight"] = Chunked(  # uneven 2-D pieces, as flexshard or TP leave them
        emb.shape,
        emb.dtype,
        [((0, 0), emb[:30, :8]), ((0, 8), emb[:30, 8:]), ((30, 0), emb[30:]), ((50, 0), emb[:0])],
    )

    def to_hf(w):  # a layout change: rows reversed, then transposed
        return w.flip(0).t()

    index = save_hf(pieces, tmp_path, transforms={"model.layers.0.attn.q.weight": to_hf})
    assert index["weight_map"] == dict.fromkeys(sd, "model.safetensors")
    loaded = load_file(str(tmp_path / "model.safetensors"))  # the reference reader
    assert torch.equal(loaded["model.embed.weight"], emb)
    assert torch.equal(loaded["model.layers.0.attn.q.weight"], to_hf(q))
    assert all(torch.equal(loaded[k], sd[k]) for k in sd if k != "model.layers.0.attn.q.weight")


def test_pieces_that_miss_or_overlap_elements_are_refused_before_any_file(tmp_path):
    w = torch.arange(12.0).view(4, 3)
    half = Chunked(w.shape, w.dtype, [((0, 0), w[:2])])
    overlapping = Chunked(w.shape, w.dtype, [((0, 0), w[:3]), ((2, 0), w[2:])])
    with pytest.raises(ValueError, match=r"pieces of w cover 6 of its 12 elements"):
        save_hf({"w": half}, tmp_path / "a")
    with pytest.raises(ValueError, match=r"w: pieces at \[0, 0\] \[3, 3\] and \[2, 0\].*overlap"):
        save_hf({"w": overlapping}, tmp_path / "b")
    with pytest.raises(ValueError, match="same dtype and number of elements"):
        save_hf({"w": w}, tmp_path / "c", transforms={"w": lambda t: t[:2]})
    with pytest.raises(ValueError, match=r"transforms name keys not in state_dict: \['v'\]"):
        save_hf({"w": w}, tmp_path / "d", transforms={"v": lambda t: t})
    assert not list(tmp_path.iterdir())  # not even the folders


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("sharded", [True, False])
def test_export_with_config_loads_with_auto_model_and_equal_logits(tmp_path, sharded):
    # Guards the reported bug: save_hf wrote no config.json, so from_pretrained failed.
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = _tiny_llama()
    config = model.config if sharded else model.config.to_dict()  # an object, or a dict
    index = save_hf(
        model.state_dict(),
        tmp_path,
        max_shard_size="40KB" if sharded else "5GB",
        config=config,
        generation_config=model.generation_config,
    )
    assert (len(set(index["weight_map"].values())) > 1) == sharded
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is type(model)
    ids = torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert GenerationConfig.from_pretrained(tmp_path).eos_token_id == 2
    assert not list(tmp_path.glob(".tmp-*"))


def test_interrupted_export_over_an_earlier_one_never_looks_loadable(tmp_path):
    # config.json is the commit: a stale one is removed before any weight is replaced, the
    # new one written last. Without that, old config + half-new weights would look loadable.
    model = _tiny_llama()
    storage = FaultyStorage(tmp_path, tmp_path / "fault.json")
    save_hf(model.state_dict(), storage=storage, max_shard_size="40KB", config=model.config)
    assert (tmp_path / "config.json").exists()
    storage.set_fault("erofs", match="model-00002-of")
    with pytest.raises(OSError, match="Read-only"):
        save_hf(model.state_dict(), storage=storage, max_shard_size="40KB", config=model.config)
    assert not (tmp_path / "config.json").exists()
    assert not (tmp_path / "model.safetensors.index.json").exists()


def test_bad_config_is_refused_before_any_file(tmp_path):
    sd = {"w": torch.zeros(2)}
    with pytest.raises(TypeError, match=r"config must be a transformers config .* got object"):
        save_hf(sd, tmp_path / "a", config=object())
    with pytest.raises(TypeError, match="config must hold only JSON values"):
        save_hf(sd, tmp_path / "b", config={"model_type": "llama", "bad": {1, 2}})
    with pytest.raises(ValueError, match="generation_config needs config"):
        save_hf(sd, tmp_path / "c", generation_config={"eos_token_id": 2})
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("size", "expected"),
    [(1000, 1000), ("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), ("1.5kb", 1500), ("10 B", 10)],
)
def test_shard_sizes_parse(size, expected):
    assert parse_size(size) == expected


@pytest.mark.parametrize("size", ["five", "0", 0, "3 parsecs"])
def test_bad_shard_size_is_refused(size):
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(size)
