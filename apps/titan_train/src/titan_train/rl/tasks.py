"""The built-in RL tasks: for each, the corpus of its starting run, its training rollouts
and its held-out evaluation.

Single-turn tasks (``arithmetic``, ``arithmetic_slip``, ``shapes``) are ``titan_rl.Task``s
scored by exact match; environment tasks (``sorting``, ``tool_calc``, ``search``, ``code``)
are multi-turn ``titan_rl`` environments played by a ``titan_rl.Rollouter``, whose starting
run is a chat SFT on the environment's demonstrations (``titan_train.environments``).

A task's evaluation plays held-out problems greedily through a ``titan_rl.Generator`` (the
trainer's model in one process, the generator replicas otherwise) and reports
``reward_mean`` plus the task's own breakdown.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from torch import nn

import titan_models
import titan_rl
from titan_train.config import JobConfig
from titan_train.data.arithmetic import Problem, answer_breakdown, arithmetic_problem
from titan_train.data.tokenizers import ByteTokenizer

if TYPE_CHECKING:  # annotations only: rl.config imports this module to check task names
    from titan_train.rl.config import RLJob

Evaluate = Callable[[titan_rl.Generator], dict[str, float]]


@dataclass(frozen=True, slots=True)
class BuiltTask:
    """A task made ready for one job."""

    source: Any
    """The training rollouts: ``source(generator, request) -> RolloutBatch``."""
    evaluate: Evaluate
    """Held-out metrics of the policy behind a generator (``reward_mean`` among them)."""
    sampling: titan_rl.SamplingParams
    """How training rollouts are sampled."""


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """A built-in task."""

    summary: str
    """One line for --list-recipes."""
    corpus: Callable[[JobConfig], str]
    """Sets the starting run's corpus on the pre-training recipe's config; returns the run-name
    suffix that tells that corpus apart."""
    init_steps: int
    """Training steps of the starting run by default."""
    build: Callable[[RLJob, ByteTokenizer, nn.Module], BuiltTask]
    """``build(job, tokenizer, model)``: the task ready for ``job``."""


def _greedy(job: RLJob, tokenizer: ByteTokenizer, stop: tuple[int, ...]) -> titan_rl.SamplingParams:
    return titan_rl.SamplingParams(
        max_new_tokens=job.rl.max_new_tokens, temperature=0.0, stop_token_ids=stop
    )


def _sampling(job: RLJob, stop: tuple[int, ...]) -> titan_rl.SamplingParams:
    return titan_rl.SamplingParams(
        max_new_tokens=job.rl.max_new_tokens,
        temperature=job.rl.temperature,
        stop_token_ids=stop,
    )


def _task_rollouts(job: RLJob, task: titan_rl.Task, sampling: titan_rl.SamplingParams) -> Any:
    return titan_rl.TaskRollouts(
        task, num_prompts=job.rl.num_prompts, group_size=job.rl.group_size, sampling=sampling
    )


# Arithmetic: the app's pre-training corpus is the task (same problems, other seeds).


@dataclass(frozen=True, slots=True)
class _Arithmetic:
    reverse_answer: bool = False
    slip_rate: float = 0.0
    digit_credit: float = 0.0
    max_operand: int = 99

    def corpus(self, job: JobConfig) -> str:
        job.data.source = "arithmetic"
        job.data.arithmetic_slip_rate = self.slip_rate
        job.data.arithmetic_reverse_answer = self.reverse_answer
        suffix = f"_slip{self.slip_rate:g}" if self.slip_rate else ""
        return suffix + ("_rev" if self.reverse_answer else "")

    def problems(self, seed: int) -> Callable[[int], Problem]:
        """Problem ``i`` for ``seed``, always with the true answer (never the slip rule)."""

        def problem(index: int) -> Problem:
            return arithmetic_problem(
                seed, index, max_operand=self.max_operand, reverse_answer=self.reverse_answer
            )

        return problem

    def build(self, job: RLJob, tokenizer: ByteTokenizer, model: nn.Module) -> BuiltTask:
        stop = (tokenizer.eos_id,)
        task = titan_rl.ExactMatchTask(
            tokenizer, self.problems(job.rl.seed), digit_credit=self.digit_credit
        )
        held_out_problem = self.problems(job.eval.seed)
        heldout = titan_rl.ExactMatchTask(tokenizer, held_out_problem)
        problems = [held_out_problem(i) for i in range(job.eval.count)]
        prompts = heldout.prompts(0, job.eval.count)
        greedy = _greedy(job, tokenizer, stop)

        def evaluate(generator: titan_rl.Generator) -> dict[str, float]:
            out = generator.generate([p.ids for p in prompts], greedy, list(range(len(prompts))))
            out.validate(len(prompts))
            eos = tokenizer.eos_id  # a response without EOS is no answer ("truncated")
            answers = [heldout.completion_text(r) if eos in r else "" for r in out.responses()]
            ev = answer_breakdown(problems, answers, reverse_answer=self.reverse_answer)
            return {"reward_mean": ev["accuracy"], **ev}

        sampling = _sampling(job, stop)
        return BuiltTask(_task_rollouts(job, task, sampling), evaluate, sampling)


def _shapes_corpus(job: JobConfig) -> str:
    if job.data.source != "shapes":
        raise ValueError(
            f"task='shapes': init.recipe pre-trains on data.source={job.data.source!r}; use a "
            "vision-language recipe on the shapes corpus (e.g. qwen3_vl_debug)"
        )
    return ""


def _shapes_build(job: RLJob, tokenizer: ByteTokenizer, model: nn.Module) -> BuiltTask:
    from titan_train.rl.shapes import ShapesTask

    stop = (tokenizer.eos_id,)
    config = cast(titan_models.TransformerConfig, model.config)  # nn.Module's __getattr__
    task = ShapesTask(tokenizer, config, split="train", seed=job.rl.seed)
    heldout = ShapesTask(tokenizer, config, split="validation", seed=job.eval.seed)
    prompts = heldout.prompts(0, job.eval.count)
    kinds = heldout.kinds(0, job.eval.count)
    greedy = _greedy(job, tokenizer, stop)

    def evaluate(generator: titan_rl.Generator) -> dict[str, float]:
        images = titan_rl.batch_images([p.images for p in prompts])
        ids, seeds = [p.ids for p in prompts], list(range(len(prompts)))
        # titan_rl.Generator documents images= (vision-language generators) but does not
        # declare it (a titan_rl Protocol to fix)
        out = generator.generate(ids, greedy, seeds, images=images)  # pyrefly: ignore[unexpected-keyword]
        out.validate(len(prompts))
        scores = [heldout.score(p, r).score for p, r in zip(prompts, out.responses(), strict=True)]
        ev = heldout.breakdown(kinds, scores)
        return {"reward_mean": ev["accuracy"], **ev}

    sampling = _sampling(job, stop)
    return BuiltTask(_task_rollouts(job, task, sampling), evaluate, sampling)


# Multi-turn environments (titan_train.environments): a chat SFT on demonstrations starts them.


class _Shifted:
    """An environment whose problem ``seed`` is the inner one's ``offset + seed``: training and
    held-out problems are disjoint ranges of the environment's problems."""

    def __init__(self, env: Any, offset: int) -> None:
        self.env, self.offset = env, offset

    def reset(self, seed: int) -> list[Any]:
        return self.env.reset(self.offset + seed)

    def step(self, message: Any) -> Any:
        return self.env.step(message)


class EpisodeRollouts:
    """The controller's rollout source over a ``titan_rl.Rollouter``: each group of a request
    is ``rollout_group`` of its dataset index, the batch built with ``from_episodes``."""

    def __init__(self, rollouter: titan_rl.Rollouter, group_size: int) -> None:
        self.rollouter, self.group_size = rollouter, group_size

    def __call__(self, generator: titan_rl.Generator, request: Any) -> titan_rl.RolloutBatch:
        groups = [
            self.rollouter.rollout_group(
                generator, request.index + g, self.group_size, request.seed
            )
            for g in range(request.num_groups)
        ]
        return titan_rl.RolloutBatch.from_episodes(groups, step=request.step)


_STRIDE = 10**7  # problems of seed s: s * _STRIDE + i (as titan_train.environments' corpus)


@dataclass(frozen=True, slots=True)
class _Environment:
    name: str

    def corpus(self, job: JobConfig) -> str:
        job.data.source = "chat"
        job.data.chat_environment = self.name
        job.data.chat_train_on = "all"  # a from-scratch model learns the problems' text too
        job.training.batch_size = 16  # short conversations: more of them per step
        # The pre-training rate (3e-3) left a fresh 3500-step tool_calc run unable to copy
        # numbers (validation loss 0.23); 1e-3 passes 0.20 by step 1500, as chat SFT prefers.
        job.optimizer.lr = 1e-3
        return f"_{self.name}"

    def build(self, job: RLJob, tokenizer: ByteTokenizer, model: nn.Module) -> BuiltTask:
        from titan_train.environments import get_environment

        spec = get_environment(self.name)
        # SimpleChatRenderer's stop_token_ids is inferred as tuple[int], Renderer declares
        # tuple[int, ...] (a titan_rl class to annotate)
        renderer: titan_rl.Renderer = titan_rl.SimpleChatRenderer(tokenizer)  # pyrefly: ignore[bad-assignment]
        sampling = _sampling(job, renderer.stop_token_ids)
        turns = dict(max_turns=job.rl.max_turns, env_workers=4)
        rollouter = titan_rl.Rollouter(
            env_factory=lambda _: _Shifted(spec.make(), job.rl.seed * _STRIDE),
            renderer=renderer,
            config=titan_rl.RolloutConfig(sampling=sampling, **turns),
        )
        heldout = titan_rl.Rollouter(
            env_factory=lambda _: _Shifted(spec.make(), job.eval.seed * _STRIDE),
            renderer=renderer,
            config=titan_rl.RolloutConfig(
                sampling=_greedy(job, tokenizer, renderer.stop_token_ids), **turns
            ),
        )

        def evaluate(generator: titan_rl.Generator) -> dict[str, float]:
            episodes = heldout.rollout_items(generator, range(job.eval.count), seed=0)
            rewards = [e.reward for e in episodes]
            turns = [len(e.weight_versions) for e in episodes]
            return {
                "reward_mean": sum(rewards) / len(rewards),
                "solved": sum(r >= 1.0 for r in rewards) / len(rewards),
                "turns_mean": sum(turns) / len(turns),
            }

        return BuiltTask(EpisodeRollouts(rollouter, job.rl.group_size), evaluate, sampling)


_CLEAN = _Arithmetic()
_SLIP = _Arithmetic(reverse_answer=True, slip_rate=0.6)

TASKS: dict[str, TaskSpec] = {
    "arithmetic": TaskSpec(
        "arithmetic problems, exact-match reward", _CLEAN.corpus, 600, _CLEAN.build
    ),
    "arithmetic_slip": TaskSpec(
        "arithmetic, answers reversed, pre-trained on a corpus where 60% of + / - answers "
        "follow a wrong carry rule; RL rewards the true answer",
        _SLIP.corpus,
        3000,
        _SLIP.build,
    ),
    "shapes": TaskSpec(
        "questions about pictures of shapes (images in the prompts)",
        _shapes_corpus,
        0,
        _shapes_build,
    ),
}
for _name, _steps in (("sorting", 1500), ("tool_calc", 3500), ("search", 1500), ("code", 1500)):
    _env = _Environment(_name)
    TASKS[_name] = TaskSpec(
        f"multi-turn environment {_name} (titan_train.environments)",
        _env.corpus,
        _steps,
        _env.build,
    )
