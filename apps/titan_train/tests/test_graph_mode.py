"""Graph mode (``--compile.mode graph``): the captured step is bitwise equal to eager, its
passes keep every bit, its dumps are readable, its artifacts load without tracing."""

from __future__ import annotations

import pytest

from titan_testing import run_distributed
from titan_train.graph.parity import build_job, compare

RECIPES = ("llama3_debug", "qwen3_debug", "qwen3_moe_debug", "deepseek_v3_debug")


@pytest.mark.parametrize("recipe", RECIPES)
def test_twenty_graph_steps_equal_eager_bitwise(tmp_path, recipe):
    r = compare(str(tmp_path), recipe, 20, [])
    assert r["losses"] == [True] * 20, r["losses"]
    assert r["params"], "parameters differ after 20 steps"
    assert r["traces"] == 1 and r["passes"] == ["noop", "dce", "bucket"]


def test_grad_accumulation_in_one_graph_is_bitwise(tmp_path):
    r = compare(str(tmp_path), "llama3_debug", 3, [], "--training.grad-accum", "2")
    assert r["losses"] == [True] * 3 and r["params"]


def test_memory_pass_saves_no_more_than_eager_remat_budget_and_stays_bitwise(tmp_path):
    import torch_remat
    from titan_train.graph.memory import saved_activations

    argv = ["--compile.passes", "noop", "dce", "memory", "--compile.memory-budget", "0.5"]
    r = compare(str(tmp_path), "llama3_debug", 3, argv)
    assert r["losses"] == [True] * 3 and r["params"]
    gm = next(iter(r["graph"].graphs.values()))
    graph_saved = sum(saved_activations(gm).values())
    # eager: torch_remat's planner at the same budget, on the same blocks and batch
    _, pm, _, loader = build_job(str(tmp_path / "eager"), "llama3_debug")
    model, batch = pm.parts[0], next(loader)
    kwargs = dict(positions=batch.positions, document_ids=batch.document_ids)
    ids = (batch.input_ids,)
    plan = torch_remat.plan(model, ids, 0.5, units="layers.*", sample_kwargs=kwargs)
    torch_remat.apply(model, plan.policies, units="layers.*")
    step = dict(kwargs=kwargs, loss_fn=lambda out: out.float().sum(), steps=1, warmup=0)
    eager = torch_remat.measure(model, ids, **step).saved_bytes
    assert 0 < graph_saved <= eager, (graph_saved, eager)
    assert "saved activations" in dict(r["graph"].stats.applied)["memory"]


def test_dump_is_readable_and_diffs_name_the_change(tmp_path):
    from titan_train.graph.dump import diff_dumps

    texts = []
    for seq in ("16", "32"):
        out = tmp_path / seq
        cfg, pm, opt, loader = build_job(
            str(out), "llama3_debug", "--compile.mode", "graph", "--compile.dump-graph",
            str(out / "dump"), "--training.seq-len", seq,
        )  # fmt: skip
        from titan_train.trainer import train_step

        train_step(pm, opt, next(loader), cfg)
        (txt,) = sorted((out / "dump").glob("step_*.txt"))
        texts.append(txt.read_text())
        assert (out / "dump" / f"{txt.stem}.passes.diff").read_text().count("\n-") > 0
    head = texts[0].splitlines()[:6]
    assert head[1].startswith("# passes: noop (removed") and "bucket" in head[1]
    assert "saved activations" in head[4] and "aten.mm.default(" in texts[0]
    assert " live " in texts[0].splitlines()[10]
    assert diff_dumps(texts[0], texts[0]) == ""
    assert "[2, 32" in diff_dumps(texts[0], texts[1]) or "32" in diff_dumps(texts[0], texts[1])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parallel.pp", "2"], "parallel.pp=2"),
        (["--model.attention-backend", "varlen"], "attention backend"),
        (["--compile.passes", "fuse"], "'fuse' is not a pass"),
        (["--compile.mode", "eager", "--compile.dump-graph", "d"], "needs compile.mode='graph'"),
    ],
)
def test_unsupported_graph_configs_are_one_clear_error(tmp_path, argv, message):
    from titan_train.build import resolve
    from titan_train.cli import parse_config
    from titan_train.errors import ConfigError

    cfg = parse_config(
        ["--output-dir", str(tmp_path), "--compile.mode", "graph",
         "--model.attention-backend", "sdpa", *argv]
    )  # fmt: skip
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        resolve(cfg, world_size=2)
    assert not any(tmp_path.iterdir())


def test_precompiled_artifact_loads_without_tracing_and_refuses_another_config(tmp_path):
    from titan_train.errors import ConfigError

    art = str(tmp_path / "step.graph")
    first = compare(str(tmp_path / "a"), "llama3_debug", 2, ["--compile.precompile", art])
    assert first["traces"] == 1 and first["loaded"] == 0
    again = compare(str(tmp_path / "b"), "llama3_debug", 2, ["--compile.precompile", art])
    assert again["traces"] == 0 and again["loaded"] == 1
    assert again["losses"] == [True, True] and again["params"]
    with pytest.raises(ConfigError, match=r"training\.seq_len is 16 in the artifact but 32 here"):
        build_job(str(tmp_path / "c"), "llama3_debug", "--compile.mode", "graph",
                  "--compile.precompile", art, "--training.seq-len", "32")  # fmt: skip


def _two_rank_cases(out: str) -> dict:
    """On each of 2 ranks: FSDP 2 for every recipe, bucketing on and off, TP 2, and the
    pre-compiled artifact (written by rank 0 in a first job, loaded by both in a second)."""
    import torch.distributed as dist

    res: dict = {}
    fsdp = ["--parallel.dp-shard", "2"]
    for recipe in RECIPES:
        r = compare(f"{out}/{recipe}", recipe, 20, [], *fsdp)
        res[recipe] = (r["losses"], r["params"], r["collectives"])
    r = compare(f"{out}/unbucketed", "llama3_debug", 3, ["--compile.passes", "noop", "dce"], *fsdp)
    res["unbucketed"] = (r["losses"], r["params"], r["collectives"])
    r = compare(f"{out}/tp", "llama3_debug", 20, [], "--parallel.tp", "2")
    res["tp"] = (r["losses"], r["params"], r["collectives"])
    art = ["--compile.precompile", f"{out}/step.graph"]
    first = compare(f"{out}/write", "llama3_debug", 3, art, *fsdp)
    dist.barrier()
    again = compare(f"{out}/load", "llama3_debug", 3, art, *fsdp)
    res["precompile"] = (first["traces"], again["traces"], again["loaded"], again["losses"])
    res["precompile_params"] = again["params"]
    return res


@pytest.mark.slow
def test_fsdp2_tp2_bucketing_and_precompile_on_two_ranks_are_bitwise(tmp_path):
    ranks = run_distributed(_two_rank_cases, 2, str(tmp_path), timeout=3000)
    for res in ranks:
        for recipe in RECIPES:
            losses, params, coll = res[recipe]
            assert losses == [True] * 20 and params, (recipe, losses)
            assert coll == {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}, coll
        losses, params, coll = res["unbucketed"]
        assert losses == [True] * 3 and params
        assert sum(coll.values()) > 2 * 2, coll  # one gather and one reduce per parameter
        losses, params, coll = res["tp"]
        assert losses == [True] * 20 and params
        assert coll, "TP's collectives are nodes of the graph"
        assert res["precompile"] == (1, 0, 1, [True] * 3) and res["precompile_params"]
    assert len(ranks) == 2


def test_graph_mode_trains_checkpoints_and_resumes_like_eager(tmp_path):
    from titan_train.cli import parse_config
    from titan_train.trainer import train

    common = [
        "--output-dir", str(tmp_path), "--training.steps", "4", "--training.batch-size", "2",
        "--training.seq-len", "16", "--metrics.log-every", "2", "--metrics.validate-every", "4",
        "--metrics.validation-batches", "1", "--metrics.peak-flops", "1e11",
        "--checkpoint.interval", "2", "--model.attention-backend", "sdpa",
        "--metrics.no-tensorboard",
    ]  # fmt: skip
    graph = [*common, "--compile.mode", "graph"]
    eager = train(parse_config([*common, "--name", "eager"]))["losses"]
    assert train(parse_config([*graph, "--name", "g"]))["losses"] == eager
    first = train(parse_config([*graph, "--name", "r"]), stop_after=2)["losses"]
    rest = train(parse_config([*graph, "--name", "r"]))["losses"]
    assert first + rest == eager
