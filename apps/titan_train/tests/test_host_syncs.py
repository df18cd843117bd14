"""A steady-state training step forces no device-to-host synchronisation: over steps 3-10 of
the debug recipe, every op that would make the host wait for the device (reading a value,
data-dependent shapes) happens only in the steps that log (one process and DP-shard 2).

Attention runs the dense ``sdpa`` backend here: the CPU default (``varlen``) plans its tiles
from the document lengths on the host by design, and the CUDA default (``flex``) has no CPU
backward; fake-backend mode (``test_fake_mode.py``) runs steps where any read of a device
value raises, whatever the backend."""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_testing import run_distributed

# Ops that read device data on the host, or whose output shape depends on device data.
_SYNCING = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::unique",
    "aten::_unique2",
    "aten::unique_consecutive",
    "aten::unique_dim",
    "aten::equal",
    "aten::is_nonzero",
    "aten::allclose",
    "aten::repeat_interleave",
}
STEPS, LOG_EVERY = 10, 5


class _SyncCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.step = 0
        self.seen: Counter[tuple[int, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _SYNCING and not _host_side(name, kwargs):
            self.seen[(self.step, name)] += 1
        return func(*args, **(kwargs or {}))


# Reads of host tensors on every device: torch's AdamW step counters (CPU tensors unless
# capturable), and the document-id check, which reads CPU ids on the host and is a
# device-side assertion on an accelerator (titan_models' AttentionMetadata).
_HOST_READS = {("_get_value", "optim/optimizer.py"), ("check_document_ids", "metadata.py")}


def _host_side(name: str, kwargs: dict | None) -> bool:
    """Reads that stay on the host: ``repeat_interleave`` given its output size, and the
    host-tensor reads of ``_HOST_READS``."""
    if name == "aten::repeat_interleave":
        return bool(kwargs)
    return name == "aten::_local_scalar_dense" and any(
        frame.name == fn and frame.filename.endswith(path)
        for frame in traceback.extract_stack(limit=8)
        for fn, path in _HOST_READS
    )


def _syncs_per_step(out_dir: str, *argv: str) -> dict[int, dict[str, int]]:
    """Syncing ops by the step whose loop iteration ran them (train step + the loop body)."""
    import titan_train.trainer as trainer
    from titan_train.cli import parse_config

    counter = _SyncCounter()
    step_fn = trainer.train_step

    def counted(*args, **kwargs):
        counter.step += 1
        return step_fn(*args, **kwargs)

    trainer.train_step = counted
    cfg = parse_config(
        [
            "--output-dir", out_dir, "--name", "syncs",
            "--training.steps", str(STEPS), "--training.batch-size", "4",
            "--training.seq-len", "32", "--metrics.log-every", str(LOG_EVERY),
            "--metrics.validate-every", "0", "--metrics.no-tensorboard",
            "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0", "--training.grad-accum", "2",
            "--model.attention-backend", "sdpa",
            *argv,
        ]
    )  # fmt: skip
    try:
        with counter:
            trainer.train(cfg)
    finally:
        trainer.train_step = step_fn
    out: dict[int, dict[str, int]] = {}
    for (step, name), n in counter.seen.items():
        out.setdefault(step, {})[name] = n
    return out


def _outside_log_steps(syncs: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    return {s: ops for s, ops in syncs.items() if 3 <= s <= STEPS and s % LOG_EVERY}


def test_no_host_sync_outside_log_steps_on_one_process(tmp_path):
    syncs = _syncs_per_step(str(tmp_path))
    assert _outside_log_steps(syncs) == {}, syncs
    assert syncs.get(LOG_EVERY), "the log steps do read values (the detector sees them)"


def test_no_host_sync_outside_log_steps_under_dp_shard_2(tmp_path):
    ranks = run_distributed(_syncs_per_step, 2, str(tmp_path), "--parallel.dp-shard", "2")
    for syncs in ranks:
        assert _outside_log_steps(syncs) == {}, syncs
    torch.testing.assert_close(len(ranks), 2)
