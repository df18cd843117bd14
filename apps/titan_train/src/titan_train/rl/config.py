"""Typed configuration of an RL job (``titan-train rl``): the starting run, the task, the
rollout and update loops, the loss, the held-out evaluation.

Experiment knobs (corpus variants, reward shaping) live in named tasks and recipes
(``titan_train.rl.tasks``, ``titan_train.rl.recipes``); the CLI reaches the general fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from titan_rl import LossConfig


@dataclass(kw_only=True, slots=True)
class InitConfig:
    """Where the starting weights come from: the HF export of an app training run on the
    task's corpus, trained first (and announced) when its run folder has none."""

    recipe: str = "llama3_debug"
    """Pre-training recipe of the starting run (the task sets its corpus)."""
    steps: int = 0
    """Its training steps; 0 keeps the task's default (another value names the run
    <recipe>_<task corpus>_<steps>)."""


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """The rollout and policy-update loops and where they run."""

    steps: int = 400
    """Most policy updates (trainer steps)."""
    generators: int = 0
    """Generator replicas, each its own process (Monarch actors) behind a router; 0 samples
    in the trainer's process (one process in all when trainer_ranks is 1)."""
    trainer_ranks: int = 1
    """Data-parallel trainer ranks (flexshard); more than 1 runs the trainer as Monarch
    actors with their own process group."""
    max_offpolicy_steps: int = 0
    """Most weight versions a trained rollout may lag the trainer (0: synchronous)."""
    rollout_workers: int = 0
    """Rollout requests in flight at once; 0 picks 2 per generator replica (at least 2)."""
    num_prompts: int = 16
    """Prompts (groups) per step."""
    group_size: int = 8
    """Rollouts per prompt (the group of group-relative advantages)."""
    num_minibatches: int = 1
    """Optimizer steps per rollout batch."""
    lr: float = 1e-4
    """AdamW learning rate (constant, no weight decay)."""
    temperature: float = 1.0
    """Rollout sampling temperature."""
    max_new_tokens: int = 6
    """Most tokens of one model turn."""
    max_turns: int = 1
    """Most model turns of an episode (environment tasks)."""
    batch_invariant: bool = False
    """Generator and trainer log-probs bitwise equal (titan_rl.batch_invariant)."""
    pack_sequences: bool = True
    """The trainer's log-probs over packed rows (episodes end to end, document ids, no
    padding); rows with images stay padded."""
    time_budget_s: float = 0.0
    """Stop the updates after this many seconds (0: no limit); the final evaluation runs."""
    seed: int = 1
    """Seed of the training prompts and of every rollout's sampling."""
    threads: int = 0
    """torch threads per process (0: torch's default in one process; 1 per process when the
    loops run on actors)."""
    checkpoint_interval: int = 0
    """Save the trainer and the controller's position every N steps (0: never)."""


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Held-out evaluation: greedy rollouts of problems the training never draws."""

    count: int = 512
    """Held-out problems per evaluation."""
    every: int = 50
    """Evaluate every N steps (0: only before and after)."""
    seed: int = 1000
    """Seed of the held-out problems (disjoint from training: it must differ from rl.seed)."""


@dataclass(kw_only=True, slots=True)
class RLJob:
    """One RL post-training job on a built-in task."""

    name: str = "arith_grpo"
    """Run name: outputs go to <output_dir>/<name>/."""
    output_dir: str = "runs"
    """Folder of run folders (the starting run's too)."""
    task: str = "arithmetic"
    """A built-in task (see titan-train rl --list-recipes): its prompts, environment, reward
    and the corpus of its starting run."""
    init: InitConfig = field(default_factory=InitConfig)
    """The starting weights."""
    rl: LoopConfig = field(default_factory=LoopConfig)
    """The loops."""
    loss: LossConfig = field(default_factory=lambda: LossConfig(correction="tis"))
    """The policy loss (clipping, aggregation, KL, off-policy correction)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The held-out evaluation."""


def validate_rl(job: RLJob) -> None:
    """Reject values no run can use, naming the field (before anything is trained or written)."""
    from titan_train.rl.tasks import TASKS

    r, e = job.rl, job.eval
    if job.task not in TASKS:
        raise ValueError(f"task={job.task!r} is unknown; tasks: {', '.join(sorted(TASKS))}")
    for name in ("steps", "num_prompts", "num_minibatches", "max_new_tokens", "max_turns"):
        if getattr(r, name) < 1:
            raise ValueError(f"rl.{name}={getattr(r, name)} must be >= 1")
    for name in ("generators", "max_offpolicy_steps", "rollout_workers", "threads"):
        if getattr(r, name) < 0:
            raise ValueError(f"rl.{name}={getattr(r, name)} must be >= 0")
    if r.trainer_ranks < 1:
        raise ValueError(f"rl.trainer_ranks={r.trainer_ranks} must be >= 1")
    if r.group_size < 2:
        raise ValueError(f"rl.group_size={r.group_size} must be >= 2")
    if not r.lr > 0:
        raise ValueError(f"rl.lr={r.lr} must be > 0")
    if not r.temperature > 0:
        raise ValueError(f"rl.temperature={r.temperature} must be > 0 (sampling)")
    if r.time_budget_s < 0 or r.checkpoint_interval < 0:
        raise ValueError(
            f"rl.time_budget_s={r.time_budget_s} and rl.checkpoint_interval="
            f"{r.checkpoint_interval} must be >= 0"
        )
    if (r.num_prompts * r.group_size) % r.trainer_ranks:
        raise ValueError(
            f"rl.trainer_ranks={r.trainer_ranks} must divide the {r.num_prompts * r.group_size} "
            "rollouts of a step (rl.num_prompts x rl.group_size)"
        )
    if e.count < 1 or e.every < 0:
        raise ValueError(f"eval.count={e.count} must be >= 1 and eval.every={e.every} >= 0")
    if e.seed == r.seed:
        raise ValueError(f"eval.seed={e.seed} must differ from rl.seed (held-out problems)")
    if job.init.steps < 0:
        raise ValueError(f"init.steps={job.init.steps} must be >= 0")
    if not job.name or "/" in job.name:
        raise ValueError(f"name={job.name!r} must be a non-empty folder name without '/'")
