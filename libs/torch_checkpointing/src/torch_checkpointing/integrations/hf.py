"""Hugging Face ``transformers`` ``Trainer`` integration (TRL's trainers are Trainers too).

``CheckpointCallback`` saves the model, optimizer, LR scheduler, RNG states and the trainer's
position asynchronously with ``CheckpointManager``, and resumes bit for bit through the
Trainer's own resume path::

    from torch_checkpointing.integrations.hf import CheckpointCallback

    ckpt = CheckpointCallback("ckpt", keep_last=2)
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[ckpt])
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))  # None on a fresh run

Importing this module does not import ``transformers``; the first use of
``CheckpointCallback`` does (``pip install titan-checkpointing[hf]``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["CheckpointCallback"]

if TYPE_CHECKING:  # pragma: no cover
    from ._hf_trainer import CheckpointCallback


def __getattr__(name: str) -> Any:
    if name == "CheckpointCallback":
        from ._hf_trainer import CheckpointCallback

        globals()[name] = CheckpointCallback
        return CheckpointCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
