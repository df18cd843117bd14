"""``titan-train rl``: RL post-training of the app's models with titan_rl (see ``run``)."""

from titan_train.rl.cli import main
from titan_train.rl.config import EvalConfig, InitConfig, LoopConfig, RLJob, validate_rl
from titan_train.rl.recipes import RL_RECIPES, get_rl_recipe

__all__ = [
    "RL_RECIPES",
    "EvalConfig",
    "InitConfig",
    "LoopConfig",
    "RLJob",
    "get_rl_recipe",
    "main",
    "validate_rl",
]
