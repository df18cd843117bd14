"""``titan-train``: pick a recipe, override any field, run (or dry-run) the job.

Launcher flags (``--recipe``, ``--list-recipes``, ``--print-config``, ``--dry-run``,
``--nproc``) are read first; every other argument overrides a field of the recipe's config
through tyro (``--optimizer.lr 3e-4``, ``--parallel.tp 2``). ``titan-train rl ...`` runs GRPO
post-training instead (``titan_train.rl``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

import tyro

from titan_train.config import JobConfig, validate
from titan_train.recipes import DEFAULT_RECIPE, get_recipe, list_recipes


def _launcher_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="titan-train", add_help=False)
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help="recipe name (see --list-recipes)")
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


def parse_config(argv: list[str], recipe: str = DEFAULT_RECIPE) -> JobConfig:
    """The recipe's config with ``argv``'s field overrides applied and validated."""
    cfg = tyro.cli(JobConfig, default=get_recipe(recipe), args=argv, prog="titan-train")
    validate(cfg)
    return cfg


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``titan-train`` command."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rl"]:
        from titan_train.rl import main as rl_main

        return rl_main(argv[1:])
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
        cfg = parse_config(rest, launcher.recipe)
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
    from titan_train.trainer import ConfigError, NonFiniteError, prepare, train
    from torch_checkpointing import CheckpointError

    if launcher.nproc > 1 and "LOCAL_RANK" not in os.environ:
        try:  # every check that needs no process, before launching any
            prepare(dataclasses.replace(cfg), world_size=launcher.nproc)
        except ConfigError as e:
            print(f"titan-train: error: {e}", file=sys.stderr)
            return 2
        return _relaunch(launcher.nproc, argv)
    # Only errors about the config become one line; anything else keeps its traceback.
    try:
        train(cfg)
    except ConfigError as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 2
    except NonFiniteError as e:
        print(f"titan-train: error: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:  # a disk that is full or read-only, a lost connection
        print(f"titan-train: error: checkpoint: {e}", file=sys.stderr)
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


def _relaunch(nproc: int, argv: list[str]) -> int:
    """Run this same command on ``nproc`` processes through torchrun."""
    from torch.distributed.run import main as torchrun

    args = [a for a in argv if not a.startswith("--nproc")]
    if "--nproc" in argv:  # "--nproc N" form: drop the value too
        i = argv.index("--nproc")
        args = argv[:i] + argv[i + 2 :]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # A rank that fails ends the others within the monitor interval; a stopped one is ended
    # by its peers' process-group timeout (comm.timeout_s) or its own step watchdog.
    launch = ["--standalone", f"--nproc-per-node={nproc}", f"--monitor-interval={MONITOR_S}"]
    try:
        torchrun([*launch, "-m", "titan_train", *args])
    except ChildFailedError as e:
        failures = ", ".join(
            f"rank {rank} exit code {f.exitcode}" for rank, f in sorted(e.failures.items())
        )
        print(f"titan-train: error: the job failed ({failures}); see above", file=sys.stderr)
        return 2 if all(f.exitcode == 2 for f in e.failures.values()) else 1
    return 0


MONITOR_S = 0.5
"""How often torchrun checks its ranks (seconds)."""


if __name__ == "__main__":
    sys.exit(main())
