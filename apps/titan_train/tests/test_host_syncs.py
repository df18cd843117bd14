"""A steady-state training step forces no device-to-host synchronisation: over the steady
steps of every debug recipe, every op that would make the host wait for the device (reading
a value, data-dependent shapes, a copy to the host) happens only in the steps that log.

The recipes: dense Llama (sdpa and varlen attention), MoE with local experts, FP8
(emulated kernels), Qwen3.5 (linear attention), DeepSeek-V4, Qwen3-VL with images, in this
process (the other debug recipes in the slow step); DP-shard 2, MoE with EP 2, CP 2 and PP 2 in one spawn of two ranks, with EP 2 once
more on exact (host-read) buffer sizes: the detector must see that read, and the losses
must be bitwise those of the static shapes.

Two detectors: a dispatch mode for the ops that read or size by device data, and a function
mode for ``Tensor.tolist`` / ``numpy`` / ``cpu``, which a CPU tensor serves without an op.
On CUDA (``-m gpu``, a gpu_check step) a third counts what CUDA reports in its sync debug
mode, over llama3_debug and qwen3_moe_debug (torch and Triton grouped GEMMs), in bf16.

Named exceptions, each a read of a *host* tensor that an accelerator never makes:

- the ``varlen`` backend's tile plan (``varlen._plan``): on CPU (no flash varlen kernel, no
  FlexAttention backward) the tiles are shaped by the documents' lengths, read from the
  batch's ``cu_seqlens`` in host memory, so nothing waits. On an accelerator ``varlen``
  runs torch's flash varlen kernel over the device ``cu_seqlens`` (static size, no read),
  or FlexAttention's device-built block mask where that kernel does not run;
- the data loaders (``titan_train/data/``), which build batches from host data before the
  trainer moves them to the device;
- torch's AdamW step counters (CPU tensors unless ``capturable``);
- the document-id check, which reads CPU ids (a device-side assertion on an accelerator).

``flex`` attention has no backward on CPU (torch 2.15): its forward (the block mask built
from the batch's documents, and the attention) is checked un-compiled, last. Fake-backend
mode (``test_fake_mode.py``) runs steps where any read of a device value raises, whatever
the backend.
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from titan_testing import requires_gpus, run_distributed

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
# Host copies that never reach the dispatcher on CPU (seen as tensor methods instead).
_COPIES = {"tolist", "numpy", "cpu"}
STEPS, LOG_EVERY = 6, 3
STEADY = [s for s in range(3, STEPS + 1) if s % LOG_EVERY]  # steps that do not log

# Reads of host tensors, named by (function, file; "*": any function of that file or
# folder): see the module docstring. The data loaders build batches from host data before
# the trainer moves them to the device.
_HOST_READS = {
    ("_get_value", "optim/optimizer.py"),
    ("check_document_ids", "attention_metadata.py"),
    ("_plan", "components/varlen.py"),
    ("*", "titan_train/data/"),
}
_REPO = str(Path(__file__).resolve().parents[3])
_NOT_OURS = ("/tests/", "/.venv/")


class _ByStep:
    """Counts by step (``step`` is set from outside) and remembers where in the repository
    the first of each kind was called from in a steady step."""

    step = 0

    def _start(self) -> None:
        self.step = 0
        self.seen: Counter[tuple[int, str]] = Counter()
        self.where: dict[str, str] = {}

    def count(self, name: str) -> None:
        self.seen[(self.step, name)] += 1
        if self.step in STEADY:
            self.where.setdefault(name, _caller())

    def by_step(self) -> dict[int, dict[str, int]]:
        out: dict[int, dict[str, int]] = {}
        for (step, name), n in self.seen.items():
            out.setdefault(step, {})[name] = n
        return out


class _SyncCounter(TorchDispatchMode, _ByStep):
    """Syncing ops (or those that would sync on an accelerator), by step."""

    def __init__(self) -> None:
        super().__init__()
        self._start()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name in _SYNCING and not _host_side(name, kwargs):
            self.count(name)
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._copies = _HostCopies(self)
        self._copies.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._copies.__exit__(*exc)


class _CudaSyncs(_ByStep):
    """The syncs CUDA itself reports, by step: ``torch.cuda.set_sync_debug_mode("warn")``
    makes every synchronizing CUDA call (a read, a blocking copy, a stream sync) warn; each
    warning is counted here instead of printed (a process-wide setting: a test's only)."""

    MESSAGE = "called a synchronizing CUDA operation"

    def __init__(self) -> None:
        self._start()

    def __enter__(self):
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{self.MESSAGE}")  # every one, not once
        self._show = warnings.showwarning
        warnings.showwarning = self._on_warning
        self._mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(self._mode)
        self._warnings.__exit__(*exc)

    def _on_warning(self, message, category, filename, lineno, file=None, line=None):
        if self.MESSAGE in str(message):
            self.count("cuda sync")
        else:
            self._show(message, category, filename, lineno, file, line)


class _HostCopies(TorchFunctionMode):
    """``Tensor.tolist`` / ``numpy`` / ``cpu``: device-to-host copies on an accelerator, which
    CPU tensors serve without an op the dispatch mode would see."""

    def __init__(self, counter: _SyncCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _COPIES and not _host_side(name, None):
            self.counter.count(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


def _host_side(name: str, kwargs: dict | None) -> bool:
    """Reads that stay on the host: ``repeat_interleave`` given its output size, and the
    host-tensor reads of ``_HOST_READS``."""
    if name == "aten::repeat_interleave":
        return bool(kwargs)
    stack = traceback.extract_stack(limit=12)
    return any(
        (frame.name == fn or fn == "*") and path in frame.filename
        for frame in stack
        for fn, path in _HOST_READS
    )


def _caller() -> str:
    """The innermost repository frames (not this test's) of the current call."""
    frames = [
        f"{Path(f.filename).name}:{f.lineno} {f.name}"
        for f in traceback.extract_stack()
        if f.filename.startswith(_REPO) and not any(d in f.filename for d in _NOT_OURS)
    ]
    return " <- ".join(reversed(frames[-3:]))


_COMMON = [
    "--training.steps", str(STEPS), "--training.batch-size", "4",
    "--training.seq-len", "32", "--metrics.log-every", str(LOG_EVERY),
    "--metrics.validate-every", "0", "--metrics.no-tensorboard",
    "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0", "--training.grad-accum", "2",
]  # fmt: skip


def _count_syncs(
    out_dir: str, recipe: str, *argv: str, counter: _ByStep | None = None
) -> tuple[dict, dict[str, str], list]:
    """Syncing ops (``counter``: the dispatch-mode detector by default) by the step whose loop
    iteration ran them (train step + the loop body), where each first ran in a steady step,
    and the logged losses."""
    import titan_train.trainer as trainer
    from titan_train.cli import parse_config

    counter = counter if counter is not None else _SyncCounter()
    step_fn = trainer.train_step

    def counted(*args, **kwargs):
        counter.step += 1
        return step_fn(*args, **kwargs)

    trainer.train_step = counted
    cfg = parse_config(["--output-dir", out_dir, "--name", "syncs", *_COMMON, *argv], recipe)
    try:
        with counter:  # pyrefly: ignore[bad-context-manager]  # both counters are ones
            losses = trainer.train(cfg)["losses"]
    finally:
        trainer.train_step = step_fn
    return counter.by_step(), counter.where, losses


def _steady(syncs: dict[int, dict[str, int]]) -> dict[int, dict[str, int]]:
    return {s: ops for s, ops in syncs.items() if s in STEADY}


ONE_PROCESS = {
    "llama3_sdpa": ("llama3_debug", "--model.attention-backend", "sdpa"),
    "llama3_varlen": ("llama3_debug", "--model.attention-backend", "varlen"),
    "qwen3_moe": ("qwen3_moe_debug",),
    "fp8_emulated": (
        "llama3_debug", "--quantize.linear", "fp8_rowwise", "--quantize.kernels", "emulated",
    ),
    "qwen3_5": ("qwen3_5_debug",),
    "deepseek_v4": ("deepseek_v4_debug",),
    "qwen3_vl_images": ("qwen3_vl_debug", "--training.seq-len", "64"),
}  # fmt: skip


# The other debug recipes (``-m extended``): their paths are the ones above, composed.
SLOW_ONE_PROCESS = {
    "gpt_oss": ("gpt_oss_debug",),
    "deepseek_v3": ("deepseek_v3_debug",),
    "qwen3_5_moe": ("qwen3_5_moe_debug",),
    "kimi_linear": ("kimi_linear_debug",),
    "qwen3_vl_moe_images": ("qwen3_vl_moe_debug", "--training.seq-len", "64"),
    "kimi_k25_images": ("kimi_k25_debug", "--training.seq-len", "64"),
}
CASES = [
    *sorted(ONE_PROCESS),
    *(
        pytest.param(name, marks=[pytest.mark.slow, pytest.mark.extended])
        for name in sorted(SLOW_ONE_PROCESS)
    ),
]


@pytest.mark.parametrize("case", CASES)
def test_no_host_sync_outside_log_steps_on_one_process(tmp_path, case):
    argv = ONE_PROCESS.get(case) or SLOW_ONE_PROCESS[case]
    syncs, where, _ = _count_syncs(str(tmp_path), *argv)
    assert _steady(syncs) == {}, (syncs, where)
    assert syncs.get(LOG_EVERY), "the log steps do read values (the detector sees them)"


ON_CUDA = {
    "llama3": ("llama3_debug",),
    "qwen3_moe": ("qwen3_moe_debug",),
    "qwen3_moe_triton_gemm": ("qwen3_moe_debug", "--moe.grouped-gemm", "triton"),
}
_CUDA = ["--training.device", "cuda", "--training.mixed-precision", "bf16"]


@pytest.mark.gpu
@requires_gpus(1)
@pytest.mark.parametrize("case", sorted(ON_CUDA))
def test_no_cuda_sync_outside_log_steps(tmp_path, case):
    """What CUDA reports (not what the op-level detectors infer): no synchronizing CUDA call
    in a steady step; the log steps' reads are seen (the detector works)."""
    syncs, where, _ = _count_syncs(str(tmp_path), *ON_CUDA[case], *_CUDA, counter=_CudaSyncs())
    assert _steady(syncs) == {}, (syncs, where)
    assert syncs.get(LOG_EVERY), "the log steps do read values (the detector sees them)"


def test_cuda_sync_warnings_are_counted_by_step_and_others_shown(monkeypatch):
    """The counting of ``_CudaSyncs`` without a GPU (the debug mode itself needs CUDA)."""
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    counter = _CudaSyncs()
    with warnings.catch_warnings(record=True) as shown, counter:
        for step in (1, STEADY[0], STEADY[0]):
            counter.step = step
            warnings.warn(f"{_CudaSyncs.MESSAGE} (from the test)", UserWarning, stacklevel=1)
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert counter.by_step() == {1: {"cuda sync": 1}, STEADY[0]: {"cuda sync": 2}}
    assert "cuda sync" in counter.where
    assert [str(w.message) for w in shown] == ["another warning"]


TWO_RANKS = {
    "dp_shard2": ("llama3_debug", "--parallel.dp-shard", "2"),
    "qwen3_moe_ep2": ("qwen3_moe_debug", "--parallel.dp-shard", "2", "--parallel.ep", "2"),
    # the dynamic dispatch, to show the detector sees its split-size read
    "qwen3_moe_ep2_exact_sizes": (
        "qwen3_moe_debug", "--parallel.dp-shard", "2", "--parallel.ep", "2",
        "--moe.no-static-shapes",
    ),
    "cp2": ("llama3_debug", "--parallel.cp", "2", "--parallel.dp-shard", "1"),
    "pp2": (
        "llama3_debug", "--parallel.pp", "2", "--parallel.dp-shard", "1",
        "--parallel.pp-microbatches", "2",
    ),
}  # fmt: skip


def _count_layouts(out_dir: str) -> dict[str, tuple[dict, dict[str, str], list]]:
    return {name: _count_syncs(f"{out_dir}/{name}", *argv) for name, argv in TWO_RANKS.items()}


def test_no_host_sync_outside_log_steps_on_two_ranks(tmp_path):
    ranks = run_distributed(_count_layouts, 2, str(tmp_path), timeout=900)
    bad = {
        (rank, name): (_steady(syncs), where)
        for rank, layouts in enumerate(ranks)
        for name, (syncs, where, _) in layouts.items()
        if _steady(syncs)
    }
    exact = {(rank, "qwen3_moe_ep2_exact_sizes") for rank in range(2)}
    assert set(bad) == exact, bad
    for rank in range(2):  # one read of the split sizes per MoE layer and micro-batch
        steady, where = bad[(rank, "qwen3_moe_ep2_exact_sizes")]
        assert all(ops == {"Tensor.tolist": 4} for ops in steady.values()), steady
        assert "dispatch.py" in where["Tensor.tolist"]
    # Static shapes pad and never drop: the same losses, bitwise.
    static, exact_sizes = (
        ranks[0][name][2] for name in ("qwen3_moe_ep2", "qwen3_moe_ep2_exact_sizes")
    )
    assert static == exact_sizes and len(static) == STEPS


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_reads_nothing_on_the_host(monkeypatch):
    """``flex`` where CPU allows (the forward): the block mask is built from the batch's
    document ids on the device, and nothing around the attention kernel reads back. The
    kernel call itself runs with the detectors paused: FlexAttention compiles itself even
    "eagerly", and torch.compile refuses a user dispatch mode."""
    import titan_models
    from titan_models.components import flex

    functions = flex._flex_functions

    def unseen_kernel():
        attention, create_block_mask = functions()

        def attention_unseen(*args, **kwargs):
            with _disable_current_modes():
                return attention(*args, **kwargs)

        return attention_unseen, create_block_mask

    monkeypatch.setattr(flex, "_EAGER_FLEX", True)
    monkeypatch.setattr(flex, "_flex_functions", unseen_kernel)
    model_cls, config = titan_models.get_model("llama3", "debug", attention_backend="flex")
    with torch.device("meta"):
        model = model_cls(config)
    model.init_weights(device="cpu", seed=0)
    tokens = torch.randint(
        0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
    )
    document_ids = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [3] * 32])
    counter = _SyncCounter()
    counter.step = STEADY[0]  # counted as a steady step
    with torch.no_grad(), counter:
        model(tokens, document_ids=document_ids)
    assert counter.by_step() == {}, counter.where
