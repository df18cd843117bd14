"""Multi-turn rollouts: groups of episodes of one dataset item, played in lockstep.

``Rollouter`` composes the experiment's pieces: a dataset (index -> item), an environment
factory (item -> a fresh ``Environment``), a ``Renderer``, a ``Rubric`` and the sampling
settings. ``rollout_group(generator, index, group_size, seed)`` plays ``group_size`` episodes
of item ``index``: each round, one ``generate`` call samples the next turn of every live
episode (any ``Generator``: ``TorchGenerator``, vLLM, a router over replicas); each sampled
turn is appended verbatim (ids, log-probs, weight version), the environment answers, and its
messages are rendered after it (masked out of the loss). Row ``m``'s ``k``-th turn is sampled
with a seed fixed by ``(seed, index, m, k)``, so a group is reproducible whichever generator
replica or batch produced it (bitwise with a batch-invariant generator).

Environment steps run on the calling thread, one after another (a tool's sandboxed run,
``titan_rl.run_sandboxed``, is a subprocess; ``env_workers > 1`` overlaps them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

from .compaction import CompactionPolicy, DropToolOutputs, Summarize
from .environment import Environment, Episode, StepResult, TokenSequence
from .generator import Generator, SamplingParams
from .messages import Message
from .renderer import Renderer
from .rubric import Rubric


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """How episodes are played."""

    sampling: SamplingParams
    """Sampling of every model turn (the renderer's stop tokens are added to its stops)."""
    max_turns: int = 8
    """Most environment turns per episode (summary turns not counted)."""
    max_context_tokens: int | None = None
    """Hard limit: a turn whose context plus ``max_new_tokens`` passes it is not sampled and
    the episode ends with status ``context`` (``None``: no limit)."""
    compaction: CompactionPolicy | None = None
    """What to do when the context passes the policy's budget (``titan_rl.compaction``)."""
    env_workers: int = 1
    """Threads stepping the environments of one round (> 1 overlaps sandboxed tool runs)."""

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"RolloutConfig.sampling must be SamplingParams, got {self.sampling!r}")
        if self.max_turns < 1:
            raise ValueError(f"RolloutConfig.max_turns={self.max_turns} must be >= 1")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError(
                f"RolloutConfig.max_context_tokens={self.max_context_tokens} must be >= 2 or None"
            )
        if self.compaction is not None and not isinstance(
            self.compaction, (DropToolOutputs, Summarize)
        ):
            raise TypeError(
                f"RolloutConfig.compaction must be DropToolOutputs, Summarize or None, got "
                f"{self.compaction!r}"
            )
        if self.env_workers < 1:
            raise ValueError(f"RolloutConfig.env_workers={self.env_workers} must be >= 1")


def turn_seed(seed: int, index: int, member: int, turn: int) -> int:
    """The sampling seed of group member ``member``'s ``turn``-th model turn of item ``index``."""
    return (((seed * 1_000_003 + index) * 65_536 + member) * 1_024 + turn) % (2**63)


class Rollouter:
    """Plays groups of episodes (see the module docstring)."""

    def __init__(
        self,
        *,
        env_factory: Callable[[Any], Environment],
        renderer: Renderer,
        config: RolloutConfig,
        rubric: Rubric | None = None,
        dataset: Sequence[Any] | Callable[[int], Any] | None = None,
    ) -> None:
        """``env_factory(item)``: a fresh environment for one episode of ``item``;
        ``dataset``: the items by index (a sequence or a function; ``None``: the index is
        the item). Each episode starts with ``env.reset(index)``, so every member of a group
        gets the same problem. ``rubric``: the training reward (default: the environment's)."""
        if not callable(env_factory):
            raise TypeError(
                f"env_factory must be callable item -> Environment, got {env_factory!r}"
            )
        if not isinstance(renderer, Renderer):
            raise TypeError(f"renderer must be a titan_rl.Renderer, got {type(renderer).__name__}")
        self.env_factory, self.renderer, self.config = env_factory, renderer, config
        self.rubric = rubric if rubric is not None else Rubric.environment()
        self.dataset = dataset

    def item(self, index: int) -> Any:
        """The dataset's item ``index``."""
        if self.dataset is None:
            return index
        return self.dataset(index) if callable(self.dataset) else self.dataset[index]

    def rollout_group(
        self, generator: Generator, index: int, group_size: int, seed: int
    ) -> list[Episode]:
        """``group_size`` episodes of item ``index``, scored by the rubric as one group."""
        if group_size < 1:
            raise ValueError(f"group_size={group_size} must be >= 1")
        item = self.item(index)
        envs = [self.env_factory(item) for _ in range(group_size)]
        seeds = [lambda k, m=m: turn_seed(seed, index, m, k) for m in range(group_size)]
        episodes = _play(envs, index, seeds, generator, self.renderer, self.config)
        scores = self.rubric.score_group(episodes)
        return [
            replace(
                e,
                reward=s.total,
                reward_breakdown=s.breakdown,
                reward_status="error" if "error" in s.statuses.values() else e.reward_status,
            )
            for e, s in zip(episodes, scores, strict=True)
        ]

    def rollout_items(
        self,
        generator: Generator,
        indices: Sequence[int],
        seed: int,
        config: RolloutConfig | None = None,
    ) -> list[Episode]:
        """One episode of each item ``indices[i]``, all played in lockstep (one ``generate``
        call per round: evaluation over many problems), each scored by the rubric as a group
        of one. ``config`` replaces the rollouter's (greedy sampling for evaluation, say)."""
        indices = list(indices)
        if not indices:
            raise ValueError("rollout_items needs at least one index")
        envs = [self.env_factory(self.item(i)) for i in indices]
        seeds = [lambda k, i=i: turn_seed(seed, i, 0, k) for i in indices]
        episodes = _play(envs, indices, seeds, generator, self.renderer, config or self.config)
        out = []
        for e in episodes:
            (s,) = self.rubric.score_group([e])
            status = "error" if "error" in s.statuses.values() else e.reward_status
            out.append(
                replace(e, reward=s.total, reward_breakdown=s.breakdown, reward_status=status)
            )
        return out


def run_episode(
    env: Environment,
    generator: Generator,
    renderer: Renderer,
    params: SamplingParams,
    *,
    seed: int,
    max_turns: int = 4,
) -> Episode:
    """Play one episode of ``env`` (reset with ``seed``; the ``k``-th turn sampled with
    ``turn_seed(seed, 0, 0, k)``); its reward is the environment's."""
    config = RolloutConfig(sampling=params, max_turns=max_turns)
    (episode,) = _play(
        [env], seed, [lambda k: turn_seed(seed, 0, 0, k)], generator, renderer, config
    )
    return episode


class _Play:
    """One episode in progress: its conversation, its token sequences and its turns."""

    def __init__(self, env: Environment, first: list[Message], prompt: list[int]) -> None:
        self.env, self.first = env, first
        self.context: list[Message] = list(first)  # the messages the current sequence renders
        self.transcript: list[Message] = list(first)
        self.done_sequences: list[TokenSequence] = []
        self.prompt, self.tokens, self.mask, self.logprobs = prompt, [], [], []
        self.versions: list[int] = []
        self.spans: list[tuple[int, int, int]] = []
        self.turn_rewards: list[float] = []
        self.turn_finish: list[str] = []
        self.env_turns = 0
        self.summarising = False
        self.status: str | None = None
        self.info: dict = {}

    def ids(self) -> list[int]:
        return self.prompt + self.tokens

    def append_env(self, ids: list[int]) -> None:
        self.tokens += ids
        self.mask += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)

    def append_model(self, ids: list[int], logprobs: list[float], version: int) -> None:
        start = len(self.tokens)
        self.tokens += ids
        self.mask += [True] * len(ids)
        self.logprobs += logprobs
        self.versions.append(version)
        self.spans.append((len(self.done_sequences), start, len(self.tokens)))

    def new_sequence(self, context: list[Message], prompt: list[int]) -> None:
        self.done_sequences.append(self.sequence())
        self.context, self.prompt, self.tokens, self.mask, self.logprobs = (
            context,
            prompt,
            [],
            [],
            [],
        )

    def sequence(self) -> TokenSequence:
        return TokenSequence(self.prompt, self.tokens, self.mask, self.logprobs)

    def episode(self) -> Episode:
        return Episode(
            sequences=[*self.done_sequences, self.sequence()],
            messages=self.transcript,
            turn_rewards=self.turn_rewards,
            weight_versions=self.versions,
            turn_spans=self.spans,
            turn_finish=self.turn_finish,
            status=self.status or "max_turns",
            reward=float(sum(self.turn_rewards)),
            reward_status=str(self.info.get("status", self.status or "max_turns")),
            info=self.info,
        )


def _play(
    envs: Sequence[Environment],
    reset_seed: int | Sequence[int],
    seeds: Sequence[Callable[[int], int]],
    generator: Generator,
    renderer: Renderer,
    config: RolloutConfig,
) -> list[Episode]:
    """Play one episode per environment in lockstep (``seeds[m](k)``: the seed of episode
    ``m``'s ``k``-th model turn; ``reset_seed``: one for all, or one per environment); rewards
    are the environments' (no rubric)."""
    stops = tuple(dict.fromkeys((*config.sampling.stop_token_ids, *renderer.stop_token_ids)))
    params = replace(config.sampling, stop_token_ids=stops)
    plays = []
    resets = [reset_seed] * len(envs) if isinstance(reset_seed, int) else list(reset_seed)
    for env, reset in zip(envs, resets, strict=True):
        first = list(env.reset(reset))
        if not first or any(not isinstance(m, Message) for m in first):
            raise TypeError(f"{type(env).__name__}.reset must return a non-empty list of Message")
        plays.append(_Play(env, first, renderer.continuation([], first)))
    for p in plays:
        _fit(p, renderer, config)
    calls = [0] * len(plays)
    pool = ThreadPoolExecutor(config.env_workers) if config.env_workers > 1 else None
    try:
        while live := [i for i, p in enumerate(plays) if p.status is None]:
            out = generator.generate(
                [plays[i].ids() for i in live], params, [seeds[i](calls[i]) for i in live]
            )
            out.validate(len(live))  # a broken generator must not reach the loss
            stepping = []
            for row, (i, ids) in enumerate(zip(live, out.responses(), strict=True)):
                calls[i] += 1
                p = plays[i]
                p.append_model(ids, out.logprobs[row, : len(ids)].tolist(), out.weight_version)
                stopped = bool(ids) and ids[-1] in stops
                p.turn_finish.append("stop" if stopped else "length")
                if not stopped:  # closed for the template, but not the model's choice
                    p.append_env(list(renderer.stop_token_ids[:1]))
                content = renderer.tokenizer.decode(ids[:-1] if stopped else ids)
                message = Message("assistant", content)
                p.transcript.append(message)
                if p.summarising:
                    _finish_summary(p, message, renderer, config)
                    continue
                p.context.append(message)
                stepping.append((p, message))
            results = _step_all(stepping, pool)
            for (p, _), result in zip(stepping, results, strict=True):
                _after_step(p, result, renderer, config)
    finally:
        if pool is not None:
            pool.shutdown()
    return [p.episode() for p in plays]


def _step_all(stepping: list[tuple[_Play, Message]], pool) -> list[StepResult]:
    def step(item: tuple[_Play, Message]) -> StepResult:
        p, message = item
        result = p.env.step(message)
        if not isinstance(result, StepResult):
            raise TypeError(f"{type(p.env).__name__}.step must return a StepResult, got {result!r}")
        return result

    return list(pool.map(step, stepping)) if pool is not None else [step(s) for s in stepping]


def _after_step(p: _Play, result: StepResult, renderer: Renderer, config: RolloutConfig) -> None:
    p.turn_rewards.append(float(result.reward))
    p.info = dict(result.info)
    p.env_turns += 1
    if result.done:
        p.status = "done"
        return
    if p.env_turns >= config.max_turns:
        p.status = "max_turns"
        return
    new = list(result.messages)
    ids = renderer.continuation(p.context, new)
    policy = config.compaction
    if isinstance(policy, Summarize) and not _room(
        len(p.ids()) + len(ids), config, policy.budget_tokens
    ):
        new.append(policy.request())  # the policy writes the summary next
        ids = renderer.continuation(p.context, new)
        p.summarising = True
    p.append_env(ids)
    p.context += new
    p.transcript += new
    _fit(p, renderer, config)


def _room(p_len: int, config: RolloutConfig, budget: int | None) -> bool:
    return budget is None or p_len + config.sampling.max_new_tokens <= budget


def _fit(p: _Play, renderer: Renderer, config: RolloutConfig) -> None:
    """Before the next model turn: drop tool outputs past the budget, stop past the limit
    (``Summarize`` acts in ``_after_step``: its request joins the environment's messages)."""
    policy = config.compaction
    if isinstance(policy, DropToolOutputs) and not _room(
        len(p.ids()), config, policy.budget_tokens
    ):

        def fits(messages: list[Message]) -> bool:
            size = len(renderer.render(messages, add_generation_prompt=True).ids)
            return _room(size, config, policy.budget_tokens)

        compacted = policy.compact(p.context, fits)
        if compacted is not None:
            p.new_sequence(compacted, renderer.render(compacted, add_generation_prompt=True).ids)
    if not _room(len(p.ids()), config, config.max_context_tokens):
        p.status = "context"


def _finish_summary(p: _Play, summary: Message, renderer: Renderer, config: RolloutConfig) -> None:
    policy = config.compaction
    assert isinstance(policy, Summarize)
    p.turn_rewards.append(0.0)
    p.summarising = False
    context = policy.compacted(p.first, summary.content)
    p.new_sequence(context, renderer.render(context, add_generation_prompt=True).ids)
    if not _room(len(p.ids()), config, config.max_context_tokens):
        p.status = "context"
