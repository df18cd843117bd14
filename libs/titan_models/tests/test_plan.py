"""The declarative plans cover the model they describe, and the model code stays single-device."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import titan_models
from titan_models import fqn_matches
from titan_models.components import RMSNorm

SRC = Path(titan_models.__file__).parent


def _debug(family: str, **kw):
    cls, config = titan_models.get_model(family, "debug", **kw)
    with torch.device("meta"):
        return cls(config), config


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
@pytest.mark.parametrize("tied", [False, True])
def test_tensor_parallel_plan_covers_every_linear_and_norm(tp_styles, family, tied):
    model, config = _debug(family, tie_embeddings=tied)
    plan = titan_models.get_plan(config)
    modules = dict(model.named_modules())
    styles = tp_styles(plan, model)

    for name, module in modules.items():
        if isinstance(module, nn.Linear):
            assert styles[name] in (["colwise"], ["rowwise"]), name
        elif isinstance(module, nn.Embedding):
            assert styles[name] == ["rowwise"], name
        elif isinstance(module, RMSNorm):
            expected = (
                ["replicated"] if name.endswith(("q_norm", "k_norm")) else ["sequence_parallel"]
            )
            assert styles[name] == expected, name
    assert plan.tied_parameters == ((("tok_embeddings.weight", "output.weight"),) if tied else ())


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_pipeline_units_partition_the_model_in_forward_order(family):
    model, config = _debug(family)
    plan = titan_models.get_plan(config)
    names = [u.name for u in plan.pipeline_units]
    assert names == ["tok_embeddings", *(f"layers.{i}" for i in range(config.num_layers)), "head"]
    owner = {}
    for unit in plan.pipeline_units:
        params = 0
        for top in unit.modules:
            module = model.get_submodule(top)
            for pname, p in module.named_parameters(prefix=top):
                assert pname not in owner, pname
                owner[pname] = unit.name
                params += p.numel()
        assert params == unit.num_params, unit.name
    assert set(owner) == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert plan.remat_units == ("layers.*",)
    assert all(fqn_matches("layers.*", f"layers.{i}") for i in range(config.num_layers))


def test_plan_is_frozen_data():
    plan = titan_models.get_plan(titan_models.get_model("llama3", "8B")[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.remat_units = ()
    assert len(plan.pipeline_units) == 34


def test_fqn_patterns_match_one_segment_per_star():
    assert fqn_matches("layers.*.attention.wq", "layers.12.attention.wq")
    assert not fqn_matches("layers.*", "layers.1.attention")
    assert not fqn_matches("layers.*.attention.wq", "layers.1.attention.wk")


# The one exception: context-parallel attention needs the other ranks' keys and values inside
# the forward, so its three collectives (ring shift, all-gather, reduce-scatter) live in one
# module that only the ``context_parallel`` backend calls (as dist_moe holds EP's all-to-all).
COLLECTIVES = "components/context_parallel_comm.py"


def test_no_model_code_imports_torch_distributed():
    for path in SRC.rglob("*.py"):
        if path.relative_to(SRC).as_posix() == COLLECTIVES:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not any(n.startswith("torch.distributed") for n in names), path
