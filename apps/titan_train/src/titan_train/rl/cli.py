"""``titan-train rl``: pick an RL recipe, override any field, run."""

from __future__ import annotations

import argparse
import sys


def _shutdown_monarch() -> None:
    """Stop this process's Monarch client now, with time to do it: left to its exit hook
    (one second) on a loaded machine, it prints a TimeoutError traceback at exit."""
    if "monarch.actor" in sys.modules:
        from monarch.actor import shutdown_context

        try:
            shutdown_context().get(timeout=60)
        except Exception as e:  # the run's result is already out; a slow teardown is no error
            print(f"titan-train rl: note: Monarch shutdown: {type(e).__name__}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """``titan-train rl [--recipe arith_grpo] [--list-recipes] [--<group>.<field> value ...]``."""
    import tyro

    from titan_train.rl.config import RLJob, validate_rl
    from titan_train.rl.recipes import RL_RECIPES, get_rl_recipe, list_rl_recipes
    from titan_train.rl.tasks import TASKS

    argv = list(sys.argv[1:] if argv is None else argv)
    launcher = argparse.ArgumentParser(prog="titan-train rl", add_help=False)
    launcher.add_argument("--recipe", default="arith_grpo")
    launcher.add_argument("--list-recipes", action="store_true")
    known, rest = launcher.parse_known_args(argv)
    if known.list_recipes:
        for name, doc in list_rl_recipes().items():
            print(f"{name:20s} {doc}")
        print("\ntasks (--task):")
        for name, spec in sorted(TASKS.items()):
            print(f"{name:20s} {spec.summary}")
        return 0
    if known.recipe not in RL_RECIPES:
        print(
            f"titan-train rl: error: --recipe {known.recipe!r} is unknown; "
            f"RL recipes: {', '.join(sorted(RL_RECIPES))}",
            file=sys.stderr,
        )
        return 2
    job = tyro.cli(RLJob, default=get_rl_recipe(known.recipe), args=rest, prog="titan-train rl")
    try:
        validate_rl(job)
        from titan_train.rl.run import run_rl

        try:
            run_rl(job)
        finally:
            _shutdown_monarch()
    except ValueError as e:  # config errors are raised before anything is trained or written
        print(f"titan-train rl: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # a trainer rank died: one line, the run stops
        if type(e).__name__ != "TrainerDiedError":
            raise
        print(f"titan-train rl: error: {e}", file=sys.stderr)
        return 1
    return 0
