"""RL recipes: plain functions returning an ``RLJob`` (``titan-train rl --list-recipes``)."""

from __future__ import annotations

from collections.abc import Callable

from titan_rl import LossConfig
from titan_train.rl.config import EvalConfig, InitConfig, LoopConfig, RLJob

RL_RECIPES: dict[str, Callable[[], RLJob]] = {}


def rl_recipe(fn: Callable[[], RLJob]) -> Callable[[], RLJob]:
    """Register ``fn`` under its own name."""
    RL_RECIPES[fn.__name__] = fn
    return fn


def list_rl_recipes() -> dict[str, str]:
    """Recipe name -> first line of its docstring."""
    return {n: (f.__doc__ or "").strip().splitlines()[0] for n, f in sorted(RL_RECIPES.items())}


def get_rl_recipe(name: str) -> RLJob:
    """A fresh job of recipe ``name``."""
    if name not in RL_RECIPES:
        raise ValueError(
            f"--recipe {name!r} is unknown; RL recipes: {', '.join(sorted(RL_RECIPES))}"
        )
    return RL_RECIPES[name]()


@rl_recipe
def arith_grpo_clean() -> RLJob:
    """GRPO on arithmetic from a 600-step llama3_debug run on the clean corpus: learning to
    carry from the reward (starting run ~5 min, then at most 14 min of RL on 2 cores)."""
    return RLJob(
        name="arith_grpo_clean",
        task="arithmetic",
        init=InitConfig(recipe="llama3_debug", steps=600),
        rl=LoopConfig(
            steps=400,
            num_prompts=32,
            group_size=8,
            lr=3e-5,
            temperature=0.8,
            max_new_tokens=6,
            time_budget_s=840.0,
            threads=1,
        ),
        eval=EvalConfig(count=512, every=100),
    )


@rl_recipe
def arith_grpo() -> RLJob:
    """GRPO from a 3000-step llama3_debug run on a corpus with a competing wrong rule
    (answers reversed, 60% of + / - answers carry-less): RL rewards the true answer only."""
    job = arith_grpo_clean()
    job.name, job.task = "arith_grpo", "arithmetic_slip"
    job.init.steps = 3000
    return job


@rl_recipe
def shapes_grpo() -> RLJob:
    """GRPO of the qwen3_vl_debug model on the shapes questions, images in the prompts."""
    return RLJob(
        name="shapes_grpo",
        task="shapes",
        init=InitConfig(recipe="qwen3_vl_debug"),
        rl=LoopConfig(steps=100, num_prompts=8, group_size=4, lr=1e-5, max_new_tokens=8),
        loss=LossConfig(correction="tis"),
        eval=EvalConfig(count=128, every=25),
    )


def _environment_job(name: str, task: str, *, max_new_tokens: int, max_turns: int) -> RLJob:
    return RLJob(
        name=name,
        task=task,
        init=InitConfig(recipe="llama3_debug"),
        rl=LoopConfig(
            steps=200,
            num_prompts=8,
            group_size=8,
            lr=1e-4,
            temperature=1.0,
            max_new_tokens=max_new_tokens,
            max_turns=max_turns,
            batch_invariant=True,
            time_budget_s=1080.0,
        ),
        eval=EvalConfig(count=128, every=25),
    )


@rl_recipe
def tool_grpo() -> RLJob:
    """Multi-turn tool use: word problems with a sandboxed calculator, from a 3500-step chat
    SFT on demonstrations that use the tool 30% of the time; RL learns to use it once the
    starting model copies numbers (starting run ~30 min, then at most 18 min of RL)."""
    return _environment_job("tool_grpo", "tool_calc", max_new_tokens=24, max_turns=3)


@rl_recipe
def sort_grpo() -> RLJob:
    """Multi-turn sorting with feedback (which positions are wrong), from a chat SFT."""
    return _environment_job("sort_grpo", "sorting", max_new_tokens=48, max_turns=3)


@rl_recipe
def search_grpo() -> RLJob:
    """Search-R1 style: BM25 search over a generated corpus, read, answer (exact match)."""
    return _environment_job("search_grpo", "search", max_new_tokens=32, max_turns=4)


@rl_recipe
def code_grpo() -> RLJob:
    """Write a function; hidden tests run in the sandbox (reward: the share passed)."""
    return _environment_job("code_grpo", "code", max_new_tokens=96, max_turns=2)
