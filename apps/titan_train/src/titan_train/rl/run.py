"""One RL job: the starting model, the task, then titan_rl's controller — in this process, or
with the trainer and the generators as Monarch actors — with held-out evaluation, metrics,
a timeline of who was busy when, and the final model's HF export.

Where the loops run (``rl.generators``, ``rl.trainer_ranks``):

- ``0`` and ``1``: one process. ``titan_rl.Controller`` over a ``GRPOLearner`` and a
  ``TorchGenerator`` of the trainer's model (a copy of it when rollouts may lag).
- otherwise: ``titan_rl.DistributedGRPO``. ``trainer_ranks`` actor processes form their own
  process group and shard the model with flexshard; ``generators`` replica processes sample
  behind a router; weights move trainer → replicas through shared memory, versioned; this
  process holds the loops and never the model.

Outputs in ``<output_dir>/<name>/``: ``config.json``, ``metrics.jsonl`` (one ``split:
train`` line per step, ``split: eval`` lines), ``summary.json`` (``eval_reward_before`` /
``eval_reward_after``), ``timeline.json`` and ``timeline.png``, ``hf/`` (the final model).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

import titan_models
import titan_rl
from titan_train.checkpointing import write_hf
from titan_train.data.tokenizers import ByteTokenizer
from titan_train.metrics import MetricsLogger
from titan_train.rl.checkpoint import (
    ControllerCheckpoints,
    close_trainer,
    load_trainer,
    save_trainer,
    trainer_steps,
)
from titan_train.rl.config import RLJob, validate_rl
from titan_train.rl.init import starting_model
from titan_train.rl.parallel import (
    AdamW,
    FlexShardDataParallel,
    Generators,
    StartingModel,
    full_weights,
)
from titan_train.rl.tasks import TASKS, BuiltTask
from titan_train.run_folder import RunLock, archive_outputs

Announce = Callable[[str], None]
"""Prints one line of progress."""

Evaluation = Callable[[], dict[str, Any]]
"""Held-out metrics of the current policy."""


def grpo_config(job: RLJob, task: BuiltTask) -> titan_rl.GRPOConfig:
    """titan_rl's loop config of ``job``."""
    r = job.rl
    return titan_rl.GRPOConfig(
        num_prompts=r.num_prompts,
        group_size=r.group_size,
        sampling=task.sampling,
        loss=job.loss,
        mode="async" if r.max_offpolicy_steps else "sync",
        max_offpolicy_steps=r.max_offpolicy_steps,
        batch_invariant=r.batch_invariant,
        num_minibatches=r.num_minibatches,
        seed=r.seed,
        pack_sequences=r.pack_sequences,
    )


def _distributed(job: RLJob) -> bool:
    return job.rl.generators > 0 or job.rl.trainer_ranks > 1


def run_rl(job: RLJob, *, announce=print) -> dict[str, Any]:
    """Post-train ``job``; returns the summary (held-out reward before / after, steps, s)."""
    validate_rl(job)
    r = job.rl
    run_dir = Path(job.output_dir) / job.name
    if (run_dir / "summary.json").exists():
        raise ValueError(
            f"name={job.name!r}: {run_dir} already holds a finished RL run; choose another name"
        )
    tokenizer = ByteTokenizer()
    model, init_dir = starting_model(job, announce=announce)  # on torch's default threads
    threads = r.threads or (1 if _distributed(job) else 0)
    if threads:
        torch.set_num_threads(threads)
    task = TASKS[job.task].build(job, tokenizer, model)
    lock = RunLock(run_dir)  # the run folder's lock, as a pre-training run takes it
    try:
        return _run_locked(job, run_dir, model, init_dir, task, announce)
    except BaseException:
        lock.release()
        lock.discard_failed_start()
        raise
    finally:
        lock.release()


def _run_locked(
    job: RLJob,
    run_dir: Path,
    model: nn.Module,
    init_dir: Path,
    task: BuiltTask,
    announce: Announce,
) -> dict[str, Any]:
    r = job.rl
    resume_step = _resume_step(run_dir)
    config_json = json.dumps(dataclasses.asdict(job), indent=2)
    if resume_step is not None:
        saved = (run_dir / "config.json").read_text()
        if json.loads(saved) != json.loads(config_json):
            raise ValueError(
                f"name={job.name!r}: {run_dir} holds checkpoints of another config (see its "
                "config.json); resume with the same options or choose another name"
            )
        announce(f"titan-train rl: resuming {run_dir} from step {resume_step}")
    elif (run_dir / "metrics.jsonl").exists():  # a start that saved nothing: kept, moved aside
        archived = archive_outputs(run_dir)
        announce(f"titan-train rl: the earlier outputs without a checkpoint are in {archived}")
    tmp = run_dir / "config.json.tmp"
    tmp.write_text(config_json)
    tmp.replace(run_dir / "config.json")
    # The app's metrics logger: metrics.jsonl (cut back to the resumed step), loss.png.
    log = MetricsLogger(
        run_dir, total_steps=r.steps, tensorboard=False, resumed_step=resume_step or 0, echo=False
    )
    announce(
        f"titan-train rl: {job.name}: task {job.task}, from {init_dir}; "
        f"{r.trainer_ranks} trainer rank(s), "
        + (f"{r.generators} generator replica(s)" if r.generators else "generation in-process")
        + f", lag <= {r.max_offpolicy_steps}; outputs in {run_dir}"
    )
    try:
        if _distributed(job):
            result = _run_distributed(job, task, init_dir, log, announce, resume_step)
        else:
            result = _run_local(job, task, model, log, announce, resume_step)
    finally:
        log.close()
    history, timeline, before, after, weights, wall = result
    config = cast(titan_models.TransformerConfig, model.config)  # nn.Module's __getattr__
    write_hf(weights, config, run_dir / "hf")
    (run_dir / "timeline.json").write_text(json.dumps(timeline))
    draw_timeline(timeline, run_dir / "timeline.png")
    summary = {
        "eval_reward_before": before["reward_mean"],
        "eval_reward_after": after["reward_mean"],
        "gain_points": 100 * (after["reward_mean"] - before["reward_mean"]),
        "steps": len(history),
        "rl_seconds": wall,
        "max_abs_logprob_diff": max((m["max_abs_logprob_diff"] for m in history), default=0.0),
        "policy_lag_max": max((m["policy_lag_max"] for m in history), default=0),
        "heldout": f"seed {job.eval.seed}, {job.eval.count} problems",
        "before": before,
        "after": after,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    announce(
        f"titan-train rl: held-out reward {before['reward_mean']:.3f} -> "
        f"{after['reward_mean']:.3f} ({summary['gain_points']:+.1f} points) in "
        f"{len(history)} steps, {wall:.0f} s; results in {run_dir}"
    )
    return summary


def _resume_step(run_dir: Path) -> int | None:
    """The newest step with both a trainer and a controller checkpoint (None: start afresh)."""
    ckpt = run_dir / "checkpoints"
    both = set(trainer_steps(ckpt / "trainer")) & set(
        ControllerCheckpoints(ckpt / "controller").steps()
    )
    return max(both) if both else None


class _Checkpoints:
    """Saves and resumes the trainer (through ``run(fn, *args)`` on every trainer rank) and
    the controller at the same steps."""

    def __init__(self, run_dir: Path, run_on_trainer, controller) -> None:
        self.root = run_dir / "checkpoints"
        self.trainer_root = str(self.root / "trainer")
        self.run, self.controller = run_on_trainer, controller
        self.controller_ckpts = ControllerCheckpoints(self.root / "controller")

    def save(self, step: int) -> None:
        self.run(save_trainer, self.trainer_root, step)
        self.controller_ckpts.save(step, self.controller.state_dict())

    def resume(self, step: int) -> None:
        self.run(load_trainer, self.trainer_root, step)
        self.controller.load_state_dict(self.controller_ckpts.load(step))

    def close(self) -> None:
        self.run(close_trainer, self.trainer_root)


def _on_step(
    job: RLJob,
    log: MetricsLogger,
    announce: Announce,
    evaluate: Evaluation,
    start: float,
    checkpoints: _Checkpoints,
) -> Callable[[dict[str, Any]], bool]:
    """The controller's per-step callback: log, evaluate every ``eval.every`` steps, save
    every ``rl.checkpoint_interval`` steps, and stop at the time budget."""
    r = job.rl

    def on_step(m: dict[str, Any]) -> bool:
        elapsed = time.perf_counter() - start
        record = {k: v for k, v in m.items() if not isinstance(v, torch.Tensor)}
        done = m["step"] + 1  # steps done, as pre-training counts them
        record.pop("step")
        log.log(done, {**record, "elapsed_s": elapsed}, prefix="train")
        line = (
            f"step {done:4d}  reward {m['reward_mean']:.3f}  loss {m['loss']:+.4f}  "
            f"max|dlogp| {m['max_abs_logprob_diff']:.1e}  lag {m['policy_lag_max']}  "
            f"gen {m['generator_tokens_per_s']:.0f} tok/s  idle "
            f"{m['trainer_idle_fraction']:.2f}  {elapsed:6.1f}s"
        )
        if job.eval.every and done % job.eval.every == 0:
            ev = evaluate()
            log.log(done, ev, prefix="eval")
            line += f"  held-out reward {ev['reward_mean']:.3f}"
        if r.checkpoint_interval and done % r.checkpoint_interval == 0:
            checkpoints.save(done)
            line += "  (checkpoint)"
        announce(line)
        return bool(r.time_budget_s) and elapsed >= r.time_budget_s

    return on_step


def _run_local(
    job: RLJob,
    task: BuiltTask,
    model: nn.Module,
    log: MetricsLogger,
    announce: Announce,
    resume_step: int | None,
):
    """Everything in this process."""
    r, config = job.rl, grpo_config(job, task)
    optimizer = AdamW(r.lr)(model.parameters())
    learner = titan_rl.GRPOLearner(model, optimizer, config)
    # Rollouts that may lag need weights of their own; synchronous ones use the trainer's.
    gen_model = copy.deepcopy(model) if r.max_offpolicy_steps else model
    generator = titan_rl.TorchGenerator(gen_model, batch_invariant=r.batch_invariant)
    workers = r.rollout_workers or 2
    controller = titan_rl.Controller(
        # titan_rl.Policy declares `version` a settable attribute; LocalPolicy's is a read-only
        # property, and the Controller only reads it (a titan_rl Protocol to fix).
        titan_rl.LocalPolicy(learner),  # pyrefly: ignore[bad-argument-type]
        generator,
        task.source,
        config,
        titan_rl.DataflowConfig(rollout_workers=workers),
    )

    def evaluate() -> dict[str, Any]:  # the trainer's current weights, greedy
        return task.evaluate(titan_rl.TorchGenerator(model, batch_invariant=r.batch_invariant))

    checkpoints = _Checkpoints(
        Path(job.output_dir) / job.name, lambda fn, *a: [fn(learner, *a)], controller
    )

    def resumed() -> None:
        if r.max_offpolicy_steps:  # the generator's own copy of the weights
            generator.update_weights(model.state_dict(), learner.version)

    history, before, after, wall = _loop(
        job, log, announce, evaluate, checkpoints, resume_step, controller.run, resumed=resumed
    )
    weights = {k: v.detach() for k, v in model.state_dict().items()}
    return history, controller.timeline.intervals, before, after, weights, wall


def _run_distributed(
    job: RLJob,
    task: BuiltTask,
    init_dir: Path,
    log: MetricsLogger,
    announce: Announce,
    resume_step: int | None,
):
    """Trainer ranks and generator replicas as Monarch actors; the loops in this process."""
    from titan_rl.actors import DistributedGRPO, MeshConfig

    r, config = job.rl, grpo_config(job, task)
    factory = StartingModel(init_dir)
    mesh = MeshConfig(
        num_generators=max(r.generators, 1),
        trainer_ranks=r.trainer_ranks,
        num_threads=r.threads or 1,
    )
    dataflow = titan_rl.DataflowConfig(rollout_workers=r.rollout_workers or 2 * mesh.num_generators)
    with DistributedGRPO(
        model_factory=factory,
        optimizer_factory=AdamW(r.lr),
        generator_factory=Generators(factory, batch_invariant=r.batch_invariant),
        data_parallel=FlexShardDataParallel(),
        source=task.source,
        config=config,
        mesh=mesh,
        dataflow=dataflow,
    ) as rl:
        trainer, router, controller = rl.trainer, rl.router, rl.controller
        if trainer is None or router is None or controller is None:
            raise RuntimeError("DistributedGRPO.__enter__ did not start its trainer and replicas")

        def evaluate() -> dict[str, Any]:  # greedy, on the replicas' newest weights
            return task.evaluate(router)

        checkpoints = _Checkpoints(Path(job.output_dir) / job.name, trainer.run, rl)
        history, before, after, wall = _loop(
            job, log, announce, evaluate, checkpoints, resume_step, rl.train,
            before_final_eval=lambda: router.wait_loaded(trainer.version),
        )  # fmt: skip
        weights = trainer.run(full_weights)[0]
        timeline = controller.timeline.intervals
    return history, timeline, before, after, weights, wall


def _loop(
    job: RLJob,
    log: MetricsLogger,
    announce: Announce,
    evaluate: Evaluation,
    checkpoints: _Checkpoints,
    resume_step: int | None,
    train: Callable[..., list[dict[str, Any]]],
    *,
    resumed: Callable[[], None] | None = None,
    before_final_eval: Callable[[], object] | None = None,
):
    """Evaluate, resume, ``train(steps, on_step=)`` the remaining steps, evaluate again."""
    before, first = _start(job, log, announce, evaluate, checkpoints, resume_step)
    if resume_step is not None and resumed is not None:
        resumed()
    start = time.perf_counter()
    on_step = _on_step(job, log, announce, evaluate, start, checkpoints)
    try:  # an interrupted run still finishes writing the checkpoint it started
        history = train(job.rl.steps - first, on_step=on_step) if job.rl.steps > first else []
    finally:
        checkpoints.close()
    wall = time.perf_counter() - start
    if before_final_eval is not None:
        before_final_eval()
    after = evaluate()
    log.log(first + len(history), after, prefix="eval")
    return history, before, after, wall


def _start(
    job: RLJob,
    log: MetricsLogger,
    announce: Announce,
    evaluate: Evaluation,
    checkpoints: _Checkpoints,
    resume_step: int | None,
) -> tuple[dict[str, Any], int]:
    """The held-out evaluation before RL (read back on a resume) and the first step."""
    if resume_step is None:
        before = evaluate()
        log.log(0, before, prefix="eval")
        announce(f"held-out before RL: reward {before['reward_mean']:.3f}")
        return before, 0
    checkpoints.resume(resume_step)
    lines = (Path(job.output_dir) / job.name / "metrics.jsonl").read_text().splitlines()
    before = next(json.loads(x) for x in lines if '"split": "eval"' in x)
    before = {k: v for k, v in before.items() if k not in ("step", "split")}
    return before, resume_step


def draw_timeline(intervals: list[dict[str, Any]], path: Path) -> None:
    """A PNG of when each loop and each replica was busy (one lane each; the trainer's
    waits for rollouts in grey)."""
    from matplotlib.figure import Figure

    lanes = sorted({i["lane"] for i in intervals})
    fig = Figure(figsize=(12, 0.4 * len(lanes) + 1.5))  # not pyplot: no process-wide state
    ax = fig.subplots()
    for y, lane in enumerate(lanes):
        mine = [i for i in intervals if i["lane"] == lane]
        for idle, color in ((False, f"C{y % 10}"), (True, "0.85")):
            spans = [
                (i["start"], i["end"] - i["start"]) for i in mine if (i["what"] == "idle") == idle
            ]
            ax.broken_barh(spans, (y - 0.35, 0.7), color=color)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_xlabel("seconds since the loops started")
    ax.set_title("busy intervals per loop and replica (grey: the trainer waiting for rollouts)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
