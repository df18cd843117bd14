"""``titan-train rl``: GRPO post-training (titan_rl) of the built-in arithmetic model, or of a
vision-language model on the shapes questions (``task='shapes'``, images in the prompts).

The starting weights are those of a pre-training recipe's run (``<output_dir>/<run>/hf``, the
HF export of e.g. ``titan-train --recipe llama3_debug --checkpoint.export-hf``, with the corpus
options of ``pretraining_job``); when that folder does not exist the pre-training run is made
first, in process, by the app's ``train``. Then ``titan_rl.GRPOTrainer`` trains the same model
class with the arithmetic task's exact-match reward (always the true answer), and held-out
exact-match accuracy (greedy; per operator and slip share too) is measured before, during and
after.

Outputs in ``<output_dir>/<name>/``: ``config.json``, ``metrics.jsonl`` (one line per step,
``split: eval`` lines for accuracy), ``summary.json`` and the HF export of the final model.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

import titan_models
import titan_rl
from titan_train.checkpointing import write_hf
from titan_train.config import JobConfig
from titan_train.data.arithmetic import Problem, answer_breakdown, arithmetic_problem
from titan_train.data.tokenizers import ByteTokenizer


@dataclass(kw_only=True, slots=True)
class RLConfig:
    """A GRPO post-training job on a built-in task."""

    name: str = "arith_grpo"
    """Run name: outputs go to <output_dir>/<name>/."""
    task: Literal["arithmetic", "shapes"] = "arithmetic"
    """arithmetic: the built-in problems; shapes: questions about pictures of shapes (images
    in the prompt; init_recipe a vision-language one on data.source=shapes)."""
    output_dir: str = "runs"
    """Folder that holds run folders (the pre-training run's too)."""
    init_recipe: str = "llama3_debug"
    """Pre-training recipe whose run gives the starting weights (trained first if absent)."""
    init_steps: int = 0
    """Pre-training steps; 0 keeps the recipe's (another value names the run <recipe>_<steps>)."""
    init_slip_rate: float = 0.0
    """The pre-training corpus's data.arithmetic_slip_rate: chance that a + / - document shows
    the slip rule (carry-less +, borrow-less -) instead of the true answer. Not 0: the run is
    named <recipe>[_<steps>]_slip<rate>. The RL reward and the held-out metric always use the
    true answer."""
    reverse_answer: bool = False
    """Answers written least-significant digit first, in the pre-training corpus (its run is
    then named ..._rev), the RL task and the held-out problems alike."""
    steps: int = 400
    """Most GRPO steps."""
    time_budget_s: float = 840.0
    """Stop after this many seconds of RL (0: no limit); the final evaluation runs anyway."""
    num_prompts: int = 16
    """Prompts per step."""
    group_size: int = 8
    """Responses per prompt."""
    lr: float = 1e-4
    """AdamW learning rate (no weight decay, constant)."""
    num_minibatches: int = 1
    """Optimizer steps per rollout batch."""
    temperature: float = 1.0
    """Rollout sampling temperature."""
    max_new_tokens: int = 6
    """Most answer tokens (an answer has at most 4 digits plus EOS for max_operand 999)."""
    mode: Literal["sync", "async"] = "sync"
    """titan_rl rollout mode."""
    max_offpolicy_steps: int = 1
    """Async mode's staleness bound."""
    batch_invariant: bool = False
    """Generator and trainer log-probs bitwise equal (slower; see titan_rl's README)."""
    digit_credit: float = 0.0
    """Training reward for a wrong answer of the right length: this times its fraction of right
    digits (0: exact match only). The held-out metric is always exact match."""
    correction: Literal["none", "tis", "mis"] = "tis"
    """Off-policy correction of the generator/trainer ratio."""
    train_seed: int = 1
    """Seed of the RL prompts (pre-training used seed 0's problems)."""
    heldout_seed: int = 1000
    """Seed of the held-out evaluation problems (disjoint from training by seed)."""
    heldout_count: int = 512
    """Held-out problems per evaluation."""
    max_operand: int = 99
    """Largest operand of + and - problems, training and held-out alike."""
    eval_every: int = 50
    """Evaluate held-out accuracy every N steps (0: only before and after)."""
    threads: int = 0
    """torch intra-op threads (0: leave torch's default)."""


def arith_grpo_clean() -> RLConfig:
    """GRPO on arithmetic from a 600-step llama3_debug run on the clean corpus (made first if
    absent, ~5 min), then at most 14 min of RL on 2 cores: learning a new skill (carrying)
    from the reward, which gave +6.6 points (see docs/benchmarks/titan_rl.md)."""
    return RLConfig(
        init_steps=600,
        lr=3e-5,
        num_prompts=32,
        group_size=8,
        temperature=0.8,
        eval_every=100,
        threads=1,
    )


def arith_grpo() -> RLConfig:
    """GRPO from a 3000-step llama3_debug run on a corpus with a competing wrong rule: answers
    written least-significant digit first, 60% of the + / - documents with carry-less /
    borrow-less answers (docs/benchmarks/titan_rl.md says why); RL rewards the true answer only.
    At most 14 min of RL on 2 cores; pre-training is made first if absent (~20 min)."""
    cfg = arith_grpo_clean()
    cfg.init_steps = 3000
    cfg.init_slip_rate = 0.6
    cfg.reverse_answer = True
    return cfg


def shapes_grpo() -> RLConfig:
    """GRPO of the qwen3_vl_debug model (its default pre-training run, made first if absent)
    on the shapes questions, images in the prompts."""
    return RLConfig(
        name="shapes_grpo",
        task="shapes",
        init_recipe="qwen3_vl_debug",
        steps=100,
        num_prompts=8,
        group_size=4,
        lr=1e-5,
        max_new_tokens=8,
        heldout_count=128,
        eval_every=25,
    )


RL_RECIPES: dict[str, Callable[[], RLConfig]] = {
    "arith_grpo": arith_grpo,
    "arith_grpo_clean": arith_grpo_clean,
    "shapes_grpo": shapes_grpo,
}


def validate_rl(cfg: RLConfig) -> None:
    """Reject values no run can use, naming the field."""
    positive = ("steps", "num_prompts", "num_minibatches", "heldout_count", "max_new_tokens")
    for name in (*positive, "max_operand"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name}={getattr(cfg, name)} must be >= 1")
    if cfg.group_size < 2:
        raise ValueError(f"group_size={cfg.group_size} must be >= 2")
    if not cfg.lr > 0:
        raise ValueError(f"lr={cfg.lr} must be > 0")
    if not cfg.temperature > 0:
        raise ValueError(f"temperature={cfg.temperature} must be > 0 (sampling)")
    for name in ("init_steps", "time_budget_s", "eval_every", "threads"):
        if getattr(cfg, name) < 0:
            raise ValueError(f"{name}={getattr(cfg, name)} must be >= 0")
    if not 0.0 <= cfg.init_slip_rate <= 1.0:
        raise ValueError(f"init_slip_rate={cfg.init_slip_rate} must be in [0, 1]")
    if not 0.0 <= cfg.digit_credit < 1.0:
        raise ValueError(f"digit_credit={cfg.digit_credit} must be in [0, 1)")
    if cfg.heldout_seed == cfg.train_seed:
        raise ValueError(f"heldout_seed={cfg.heldout_seed} must differ from train_seed")
    if not cfg.name or "/" in cfg.name:
        raise ValueError(f"name={cfg.name!r} must be a non-empty folder name without '/'")


def pretraining_job(cfg: RLConfig) -> JobConfig:
    """The pre-training run whose HF export starts RL: ``init_recipe`` with the corpus options
    of ``cfg``; its name changes with every option, so runs made with others are never reused."""
    from titan_train.recipes import get_recipe

    job = get_recipe(cfg.init_recipe)
    if cfg.init_steps:
        job.training.steps = cfg.init_steps
        job.name = f"{job.name}_{cfg.init_steps}"
    if (cfg.init_slip_rate or cfg.reverse_answer) and job.data.source != "arithmetic":
        raise ValueError(
            f"init_slip_rate / reverse_answer: recipe {cfg.init_recipe!r} does not pre-train "
            "on the arithmetic corpus"
        )
    if cfg.init_slip_rate:
        job.data.arithmetic_slip_rate = cfg.init_slip_rate
        job.name = f"{job.name}_slip{cfg.init_slip_rate:g}"
    if cfg.reverse_answer:
        job.data.arithmetic_reverse_answer = True
        job.name = f"{job.name}_rev"
    wanted = "shapes" if cfg.task == "shapes" else "arithmetic"
    if job.data.source != wanted:
        raise ValueError(
            f"task={cfg.task!r}: init_recipe {cfg.init_recipe!r} pre-trains on "
            f"data.source={job.data.source!r}, not {wanted!r}"
        )
    job.output_dir = cfg.output_dir
    job.checkpoint.export_hf = True
    job.metrics.tensorboard = False
    return job


def initial_model(cfg: RLConfig) -> tuple[torch.nn.Module, Path]:
    """The pre-trained arithmetic model (trained and exported first if its run is missing)."""
    job = pretraining_job(cfg)
    hf_dir = Path(job.output_dir) / job.name / "hf"
    if not (hf_dir / "config.json").is_file():
        from titan_train.trainer import train

        train(job)
    return titan_models.from_hf(hf_dir), hf_dir


def arithmetic_problems(cfg: RLConfig, seed: int) -> Callable[[int], Problem]:
    """Problem ``i`` of the corpus for ``seed`` with ``cfg``'s operands and digit order (never
    the slip rule: the RL task and the held-out score use the true answer)."""

    def problem(index: int) -> Problem:
        return arithmetic_problem(
            seed, index, max_operand=cfg.max_operand, reverse_answer=cfg.reverse_answer
        )

    return problem


def _task_and_evaluation(
    cfg: RLConfig, tokenizer: ByteTokenizer, model: torch.nn.Module
) -> tuple[titan_rl.Task, Callable[[], dict[str, float]]]:
    """The RL task of ``cfg.task`` and its held-out evaluation: greedy answers of the trainer's
    own model (outside the rollout generator, which may lag), accuracy and its breakdown."""
    params = titan_rl.SamplingParams(
        max_new_tokens=cfg.max_new_tokens, temperature=0.0, stop_token_ids=(tokenizer.eos_id,)
    )

    def greedy(prompts: list[titan_rl.Prompt]) -> list[list[int]]:
        gen = titan_rl.TorchGenerator(model, batch_invariant=cfg.batch_invariant)
        images = titan_rl.batch_images([p.images for p in prompts])
        kwargs = {} if images is None else {"images": images}
        out = gen.generate([p.ids for p in prompts], params, list(range(len(prompts))), **kwargs)
        out.validate(len(prompts))
        return out.responses()

    if cfg.task == "shapes":
        from titan_train.rl_tasks import ShapesTask

        task = ShapesTask(tokenizer, model.config, split="train", seed=cfg.train_seed)
        heldout = ShapesTask(tokenizer, model.config, split="validation", seed=cfg.heldout_seed)
        shapes_prompts = heldout.prompts(0, cfg.heldout_count)
        kinds = heldout.kinds(0, cfg.heldout_count)

        def evaluate_shapes() -> dict[str, float]:
            responses = greedy(shapes_prompts)
            scores = [
                heldout.score(p, r).score for p, r in zip(shapes_prompts, responses, strict=True)
            ]
            return heldout.breakdown(kinds, scores)

        return task, evaluate_shapes

    task = titan_rl.ExactMatchTask(
        tokenizer, arithmetic_problems(cfg, cfg.train_seed), digit_credit=cfg.digit_credit
    )
    heldout = titan_rl.ExactMatchTask(tokenizer, arithmetic_problems(cfg, cfg.heldout_seed))
    problems = [heldout.problem(i) for i in range(cfg.heldout_count)]
    prompts = heldout.prompts(0, cfg.heldout_count)

    def evaluate() -> dict[str, float]:
        # A response without EOS is no answer (the task's score says "truncated").
        eos = tokenizer.eos_id
        answers = [heldout.completion_text(r) if eos in r else "" for r in greedy(prompts)]
        return answer_breakdown(problems, answers, reverse_answer=cfg.reverse_answer)

    return task, evaluate


def run_rl(cfg: RLConfig) -> dict[str, Any]:
    """Post-train with GRPO; returns the summary (accuracy before/after, steps, seconds)."""
    validate_rl(cfg)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    run_dir = Path(cfg.output_dir) / cfg.name
    if (run_dir / "hf").exists():
        raise ValueError(
            f"name={cfg.name!r}: {run_dir} already holds a finished RL run; choose another name"
        )
    tokenizer = ByteTokenizer()
    model, init_dir = initial_model(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))

    task, evaluate = _task_and_evaluation(cfg, tokenizer, model)
    stop = (tokenizer.eos_id,)
    grpo = titan_rl.GRPOConfig(
        num_prompts=cfg.num_prompts,
        group_size=cfg.group_size,
        sampling=titan_rl.SamplingParams(
            max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, stop_token_ids=stop
        ),
        loss=titan_rl.LossConfig(correction=cfg.correction),
        mode=cfg.mode,
        num_minibatches=cfg.num_minibatches,
        max_offpolicy_steps=cfg.max_offpolicy_steps,
        batch_invariant=cfg.batch_invariant,
        seed=cfg.train_seed,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    trainer = titan_rl.GRPOTrainer(model, optimizer, task, grpo)

    metrics_file = (run_dir / "metrics.jsonl").open("w")
    first = evaluate()
    before = first["accuracy"]
    metrics_file.write(json.dumps({"step": 0, "split": "eval", **first}) + "\n")
    print(f"held-out before RL: {_breakdown_line(first)} (from {init_dir})", flush=True)
    start = time.perf_counter()

    def on_step(m: dict[str, Any]) -> bool:
        elapsed = time.perf_counter() - start
        metrics_file.write(json.dumps({**m, "split": "train", "elapsed_s": elapsed}) + "\n")
        done = m["step"] + 1
        line = (
            f"step {done:4d}  reward {m['reward_mean']:.3f}  len {m['length_mean']:.2f}  "
            f"loss {m['loss']:+.4f}  kl(gen|train) {m['kl_generator_trainer']:.1e}  "
            f"lag {m['staleness']}  {elapsed:6.1f}s"
        )
        if cfg.eval_every and done % cfg.eval_every == 0:
            ev = evaluate()
            metrics_file.write(json.dumps({"step": done, "split": "eval", **ev}) + "\n")
            line += f"  held-out accuracy {ev['accuracy']:.3f}"
        metrics_file.flush()
        print(line, flush=True)
        return bool(cfg.time_budget_s) and elapsed >= cfg.time_budget_s

    history = trainer.train(cfg.steps, on_step=on_step)
    wall = time.perf_counter() - start
    last = evaluate()
    after = last["accuracy"]
    metrics_file.write(json.dumps({"step": len(history), "split": "eval", **last}) + "\n")
    metrics_file.close()
    write_hf(model.state_dict(), model.config, run_dir / "hf")
    summary = {
        "accuracy_before": before,
        "accuracy_after": after,
        "gain_points": 100 * (after - before),
        "steps": len(history),
        "rl_seconds": wall,
        "heldout": f"seed {cfg.heldout_seed}, {cfg.heldout_count} problems, "
        f"max_operand {cfg.max_operand}",
        "before": first,
        "after": last,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"held-out after RL: {_breakdown_line(last)}", flush=True)
    print(
        f"held-out accuracy {before:.3f} -> {after:.3f} ({summary['gain_points']:+.1f} points) "
        f"in {len(history)} steps, {wall:.0f} s",
        flush=True,
    )
    return summary


def _breakdown_line(ev: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.3f}" for k, v in ev.items())


def main(argv: list[str] | None = None) -> int:
    """``titan-train rl [--recipe arith_grpo] [--<field> value ...]``."""
    import tyro

    argv = list(sys.argv[1:] if argv is None else argv)
    launcher = argparse.ArgumentParser(prog="titan-train rl", add_help=False)
    launcher.add_argument("--recipe", default="arith_grpo")
    known, rest = launcher.parse_known_args(argv)
    if known.recipe not in RL_RECIPES:
        print(
            f"titan-train rl: error: --recipe {known.recipe!r} is unknown; "
            f"RL recipes: {', '.join(sorted(RL_RECIPES))}",
            file=sys.stderr,
        )
        return 2
    cfg = tyro.cli(RLConfig, default=RL_RECIPES[known.recipe](), args=rest, prog="titan-train rl")
    try:
        run_rl(cfg)
    except ValueError as e:  # config errors are raised before anything is trained or written
        print(f"titan-train rl: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
