"""Models are built on meta and each rank materialises only what it holds: initial weights do
not depend on the layout (bitwise), and an HF checkpoint is read piece by piece."""

from __future__ import annotations

import pytest
import torch

from titan_testing import run_distributed
from titan_train.build import build_model, resolve
from titan_train.cli import parse_config

LAYOUTS = {
    "dp2": ("llama3_debug", ["--parallel.dp-shard", "2"]),
    "tp2": ("llama3_debug", ["--parallel.tp", "2", "--parallel.dp-shard", "1"]),
    "pp2": ("llama3_debug", ["--parallel.pp", "2", "--parallel.dp-shard", "1"]),
    "qwen3_tp2": ("qwen3_moe_debug", ["--parallel.tp", "2", "--parallel.dp-shard", "1"]),
    "moe_ep2": ("qwen3_moe_debug", ["--parallel.dp-shard", "2", "--parallel.ep", "2"]),
    "dsv3_ep2": ("deepseek_v3_debug", ["--parallel.dp-shard", "2", "--parallel.ep", "2"]),
}


def _pieces(recipe: str, argv: list[str], hf_path: str = "", rss: dict | None = None) -> dict:
    """This rank's materialised pieces: key -> (global shape, [(offset, tensor)]); with
    ``rss``, also the growth of the peak RSS while materialising (``rss["growth"]``)."""
    from titan_train.build import build_parallel
    from titan_train.materialize import global_state, materialize

    extra = ["--checkpoint.init-from-hf", hf_path] if hf_path else []
    cfg = parse_config([*argv, *extra], recipe)
    pm = build_parallel(resolve(cfg), "cpu")
    if rss is not None:
        with open("/proc/self/clear_refs", "w") as f:  # the peak (VmHWM) restarts from here
            f.write("5")
        rss["before"] = _status("VmRSS")
    materialize(pm, torch.device("cpu"), seed=cfg.training.seed, hf_path=hf_path)
    if rss is not None:
        rss["growth"] = _status("VmHWM") - rss["before"]
    return {
        key: (entry.global_shape, [(o, t.detach().clone()) for o, t in entry.local_chunks()])
        for key, entry in global_state(pm).items()
    }


def _status(name: str) -> int:
    """A field of /proc/self/status, in bytes."""
    import re

    with open("/proc/self/status") as f:
        text = f.read()
    return int(re.search(rf"{name}:\s+(\d+) kB", text).group(1)) * 1024


def _all_layouts() -> dict:
    return {name: _pieces(recipe, argv) for name, (recipe, argv) in LAYOUTS.items()}


def _assemble(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's pieces; pieces held twice must agree bitwise."""
    out: dict[str, torch.Tensor] = {}
    for pieces in ranks:
        for key, (shape, chunks) in pieces.items():
            full = out.setdefault(key, torch.full(shape, float("nan")))
            for offset, t in chunks:
                index = tuple(slice(o, o + n) for o, n in zip(offset, t.shape, strict=True))
                seen = full[index]
                held = ~torch.isnan(seen)
                assert torch.equal(seen[held], t.float()[held]), key
                full[index] = t.float()
    return out


@pytest.fixture(scope="module")
def layouts():
    return run_distributed(_all_layouts, 2, timeout=900)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_initial_weights_are_bitwise_those_of_one_process(layouts, layout):
    recipe, _ = LAYOUTS[layout]
    cfg = parse_config([], recipe)
    whole = build_model(resolve(cfg), torch.device("cpu"))
    want = {**dict(whole.named_parameters()), **dict(whole.named_buffers())}
    got = _assemble([ranks[layout] for ranks in layouts])
    if layout.startswith("pp"):  # each stage holds its own layers; together, all of them
        assert set(got) == set(want)
    for key, full in got.items():
        assert not torch.isnan(full).any(), f"{key}: a piece no rank holds"
        assert torch.equal(full, want[key].detach().float()), key


# --- HF checkpoints, read piece by piece ---------------------------------------------------

HF_MODEL = dict(dim=512, num_layers=16, ffn_hidden_dim=1536, vocab_size=8192)


def _hf_pieces_and_rss(hf_path: str) -> dict:
    rss: dict = {}
    pieces = _pieces("llama3_debug", ["--parallel.dp-shard", "2"], hf_path, rss)
    return {"pieces": pieces, "growth": rss["growth"]}


def test_hf_checkpoint_is_read_shard_by_shard(tmp_path):
    import titan_models

    cls, config = titan_models.get_model("llama3", "debug", **HF_MODEL)
    whole = cls(config).init_weights(seed=5)
    path = tmp_path / "hf"
    titan_models.to_hf(whole, path)
    ranks = run_distributed(_hf_pieces_and_rss, 2, str(path), timeout=600)
    got = _assemble([r["pieces"] for r in ranks])
    for key, value in whole.state_dict().items():
        assert torch.equal(got[key], value.float()), key
    full_copy = sum(p.numel() * p.element_size() for p in whole.parameters())
    for r in ranks:
        # Each rank holds half of the model; it never holds (or maps) a full copy.
        assert r["growth"] <= 0.6 * full_copy, (r["growth"] / full_copy, full_copy)
        print(f"peak RSS growth while loading: {r['growth'] / full_copy:.3f} of a full copy")
