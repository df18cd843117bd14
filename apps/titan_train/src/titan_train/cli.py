"""``titan-train``: pick a recipe, override any field, run (or dry-run) the job.

Launcher flags (``--recipe``, ``--config``, ``--list-recipes``, ``--print-config``,
``--dry-run``, ``--nproc``) are read first; ``--config FILE`` (TOML, or a run's
``config.json``) sets fields on top of the recipe, and every other argument overrides a field
through tyro (``--optimizer.lr 3e-4``, ``--parallel.tp 2``). ``titan-train rl ...`` runs GRPO
post-training instead (``titan_train.rl``); ``titan-train lighthouse`` runs torchft's
lighthouse for fault-tolerant replica groups (``titan_train.replicas``).

Nothing here imports torch: ``--help``, ``--list-recipes`` and config errors answer at once;
the trainer is imported once a job is about to run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from titan_train.config import JobConfig, validate
from titan_train.config_file import apply_config_file
from titan_train.recipes import DEFAULT_RECIPE, get_recipe, list_recipes


def _launcher_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan-train", add_help=False)
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="recipe name (see --list-recipes)")
    p.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="TOML or JSON file of fields set on top of the recipe (a run's config.json "
        "reproduces that run); command-line overrides apply on top of it",
    )
    p.add_argument("--list-recipes", action="store_true", help="list recipes and exit")
    p.add_argument("--print-config", action="store_true", help="print the resolved config, exit")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="per-rank memory of the layout from the fake backend, with no step; exit",
    )
    p.add_argument("--nproc", type=int, default=1, help="processes to launch through torchrun")
    p.add_argument("-h", "--help", action="store_true")
    return p


def parse_config(
    argv: list[str], recipe: str = DEFAULT_RECIPE, *, config_file: str | None = None
) -> JobConfig:
    """The recipe's config with ``config_file``'s fields, then ``argv``'s overrides, applied
    and validated."""
    import tyro

    default = get_recipe(recipe)
    if config_file is not None:
        default = apply_config_file(default, config_file)
    cfg = tyro.cli(JobConfig, default=default, args=argv, prog="titan-train")
    validate(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``titan-train`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rl"]:
        from titan_train.rl import main as rl_main

        return rl_main(argv[1:])
    if argv[:1] == ["lighthouse"]:
        from titan_train.replicas import lighthouse_main

        return lighthouse_main(argv[1:])
    launcher, rest = _launcher_parser().parse_known_args(argv)
    if launcher.help:
        _launcher_parser().print_help()
        print("\nConfig overrides (any field of the recipe):\n")
        rest = [*rest, "--help"]
    if launcher.list_recipes:
        for name, doc in list_recipes().items():
            print(f"{name:20s} {doc}")
        return 0
    try:
        cfg = parse_config(rest, launcher.recipe, config_file=launcher.config)
    except ValueError as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 2
    if launcher.print_config:
        print(json.dumps(dataclasses.asdict(cfg), indent=2))
        return 0
    if launcher.nproc < 1:
        print(f"titan-train: error: --nproc={launcher.nproc} must be >= 1", file=sys.stderr)
        return 2
    if launcher.dry_run:  # the fake backend with no step: the layout's per-rank memory
        try:
            cfg = _dry_run_config(cfg)
        except ValueError as e:
            print(f"titan-train: error: {e}", file=sys.stderr)
            return 2
    if launcher.nproc > 1 and cfg.comm.fake_world_size:
        print(
            "titan-train: error: --comm.fake-world-size runs one process standing for a whole "
            f"job; it cannot be combined with --nproc {launcher.nproc}",
            file=sys.stderr,
        )
        return 2
    try:
        if cfg.fault_tolerance.local_replicas and not launcher.dry_run:
            return _run_replicas(cfg, launcher.nproc, argv)
        return _run(cfg, launcher.nproc, argv)
    except KeyboardInterrupt:  # before the first step (or a second Ctrl-C): nothing saved
        print("titan-train: interrupted before any step was saved", file=sys.stderr)
        return EXIT_INTERRUPTED


EXIT_INTERRUPTED = 130
"""Exit status of a job stopped by Ctrl-C (128 + SIGINT)."""


def _run_replicas(cfg: JobConfig, nproc: int, argv: list[str]) -> int:
    """``--fault-tolerance.local-replicas N``: every check of replica group 0's config first."""
    from titan_train.build import resolve
    from titan_train.errors import ConfigError
    from titan_train.fault_tolerance import replica_config
    from titan_train.replicas import run_local_replicas

    ft = dataclasses.replace(
        cfg.fault_tolerance,
        enable=True,
        group_size=cfg.fault_tolerance.local_replicas,
        local_replicas=0,
    )
    try:
        resolve(replica_config(dataclasses.replace(cfg, fault_tolerance=ft)), world_size=nproc)
    except ConfigError as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 2
    return run_local_replicas(cfg, argv)


def _run(cfg: JobConfig, nproc: int, argv: list[str]) -> int:
    from titan_train.build import resolve
    from titan_train.errors import (
        ConfigError,
        ExportError,
        FaultToleranceError,
        NonFiniteError,
        NoPeerToRejoin,
    )
    from titan_train.fault_tolerance import replica_config
    from titan_train.replicas import EXIT_NO_PEER
    from titan_train.run_report import Interrupted
    from torch_checkpointing import CheckpointError

    if nproc > 1 and "LOCAL_RANK" not in os.environ:
        try:  # every check that needs no process, before launching any
            resolve(replica_config(dataclasses.replace(cfg)), world_size=nproc)
        except ConfigError as e:
            print(f"titan-train: error: {e}", file=sys.stderr)
            return 2
        return _relaunch(cfg, nproc, argv)
    # Only errors about the config become one line; anything else keeps its traceback (a
    # rank of --nproc: in its log in the run folder, and one line).
    try:
        job = resolve(cfg)
        if cfg.comm.fake_world_size:  # one process standing for a job of any size
            from titan_train.fake import run_fake as runner
        else:
            from titan_train.trainer import train as runner
        runner(job)
    except ConfigError as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteError, ExportError, FaultToleranceError) as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 1
    except NoPeerToRejoin as e:
        print(f"titan-train: {e}", file=sys.stderr)
        return EXIT_NO_PEER
    except CheckpointError as e:  # a disk that is full or read-only, a lost connection
        print(f"titan-train: error: checkpoint: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"titan-train: {e}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as e:
        if "LOCAL_RANK" not in os.environ:
            raise
        from titan_train.launch import report_rank_failure  # a rank of --nproc: to its log

        report_rank_failure(cfg, int(os.environ.get("RANK", "0")), e)
        return 1
    return 0


def _dry_run_config(cfg: JobConfig) -> JobConfig:
    """``--dry-run``: fake-backend mode with 0 steps on the layout's world size."""
    p = cfg.parallel
    world = cfg.comm.fake_world_size
    if not world:
        if p.dp_shard == -1:
            raise ValueError(
                "--dry-run needs the world size: pass --comm.fake-world-size N or set "
                "parallel.dp_shard (not -1)"
            )
        world = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
    cfg.comm.fake_world_size = world
    cfg.training.steps = 0
    return cfg


def _relaunch(cfg: JobConfig, nproc: int, argv: list[str]) -> int:
    """Run this same command on ``nproc`` processes through torchrun (``titan_train.launch``)."""
    from titan_train.launch import relaunch

    args = [a for a in argv if not a.startswith("--nproc")]
    if "--nproc" in argv:  # "--nproc N" form: drop the value too
        i = argv.index("--nproc")
        args = argv[:i] + argv[i + 2 :]
    return relaunch(cfg, nproc, args)


if __name__ == "__main__":
    sys.exit(main())
