"""``titan-train`` command line (the trainer itself lands with issue 10)."""

from __future__ import annotations

import importlib
import sys

_LIBRARIES = (
    "flexshard",
    "dist_moe",
    "torch_remat",
    "torch_checkpointing",
    "titan_pipeline",
    "titan_models",
    "titan_rl",
    "titan_train",
)


def main(argv: list[str] | None = None) -> int:
    """Report the installed Titan libraries; training is not implemented yet."""
    del argv
    for name in _LIBRARIES:
        print(f"{name:22s} {importlib.import_module(name).__version__}")
    print("titan-train: the training loop is not built yet (issue 10); nothing was trained.")
    return 2


if __name__ == "__main__":
    sys.exit(main())
