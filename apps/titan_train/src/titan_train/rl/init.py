"""The starting weights of an RL job: the HF export of an app training run on the task's
corpus. When that run has no export yet it is trained first, in this process, by the app's
own ``train`` — announced with the equivalent ``titan-train`` command, since it takes minutes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

import titan_models
from titan_train.config import JobConfig
from titan_train.rl.config import RLJob


def starting_job(job: RLJob) -> JobConfig:
    """The training run whose HF export starts ``job``: ``init.recipe`` on the task's corpus.

    Its name carries the corpus and the steps; a run found under that name is reused only if
    its ``config.json`` also agrees on the other fields the task sets (``check_reused``)."""
    from titan_train.recipes import get_recipe
    from titan_train.rl.tasks import TASKS

    spec = TASKS[job.task]
    run = get_recipe(job.init.recipe)
    suffix = spec.corpus(run)
    steps = job.init.steps or spec.init_steps
    if steps:
        run.training.steps = steps
    run.name = f"{run.name}{suffix}" + (f"_{steps}" if steps else "")
    run.output_dir = job.output_dir
    run.checkpoint.export_hf = True
    run.metrics.tensorboard = False
    return run


_ANNOUNCED = (
    ("training", "steps"),
    ("training", "batch_size"),
    ("data", "source"),
    ("data", "chat_environment"),
    ("data", "chat_train_on"),
    ("data", "arithmetic_slip_rate"),
    ("data", "arithmetic_reverse_answer"),
    ("optimizer", "lr"),
)


def starting_command(run: JobConfig, recipe: str) -> str:
    """The ``titan-train`` command that makes ``run`` from ``recipe`` (the announcement): the
    fields the task changed, as flags."""
    from titan_train.recipes import get_recipe

    base = get_recipe(recipe)
    parts = [
        f"titan-train --recipe {recipe}",
        f"--name {run.name}",
        f"--output-dir {run.output_dir}",
    ]
    for section, name in _ANNOUNCED:
        value = getattr(getattr(run, section), name)
        if value == getattr(getattr(base, section), name):
            continue
        flag = f"--{section}.{name.replace('_', '-')}"
        parts.append(flag if value is True else f"{flag} {value}")
    return " ".join([*parts, "--checkpoint.export-hf"])


def check_reused(run: JobConfig, folder: Path) -> None:
    """Refuse to reuse ``folder`` (a finished starting run) unless its recorded ``config.json``
    has the model and every field the task sets (``_ANNOUNCED``) as ``run`` has them: a run
    made before the task changed one of them (the learning rate, say) is not what the task
    starts from. Nothing is deleted; the error says how to get the right run."""
    from titan_train.run_folder import config_changes

    path = folder / "config.json"
    try:
        recorded = json.loads(path.read_text())
        if not isinstance(recorded, dict):
            raise ValueError(f"a JSON {type(recorded).__name__}, not an object")
    except (OSError, ValueError) as e:
        raise ValueError(
            f"the starting run {folder} has an HF export but its {path.name} cannot be read "
            f"({e}), so it cannot be checked against this task; pass another --output-dir, or "
            "move that folder aside to train the starting run again"
        ) from None
    checked = {"model.family", "model.flavor", *(f"{s}.{n}" for s, n in _ANNOUNCED)}
    changes = config_changes(recorded, dataclasses.asdict(run))
    differ = [f"{k}={a!r} (this task: {b!r})" for k, (a, b) in changes.items() if k in checked]
    if differ:
        raise ValueError(
            f"the starting run {folder} was made with {', '.join(differ)}; it is kept as it "
            "is: pass another --output-dir, or move that folder aside, to train the task's own "
            "starting run"
        )


def starting_model(job: RLJob, *, announce=print) -> tuple[torch.nn.Module, Path]:
    """The starting model and its HF folder (trained and exported first when missing; a run
    found on disk is checked first, ``check_reused``)."""
    run = starting_job(job)
    hf_dir = Path(run.output_dir) / run.name / "hf"
    if (hf_dir / "config.json").is_file():
        check_reused(run, hf_dir.parent)
    else:
        announce(
            f"titan-train rl: the starting run {hf_dir.parent} has no HF export yet; training "
            f"it first ({run.training.steps} steps of {run.model.family} {run.model.flavor} on "
            f"the task's corpus), as: {starting_command(run, job.init.recipe)}"
        )
        from titan_train.trainer import train

        train(run)
        announce(f"titan-train rl: starting run done; RL starts from {hf_dir}")
    return titan_models.from_hf(hf_dir), hf_dir
