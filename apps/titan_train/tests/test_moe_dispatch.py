"""MoE fast paths chosen from the app: the expert-parallel dispatch and the grouped GEMM.

``--moe.dispatch symm_mem`` (dist_moe's symmetric-memory puts, emulated in shared memory
between gloo ranks on CPU) trains Qwen3-MoE at EP 2 bitwise like ``all_to_all``: the owner
regroups the received blocks into all-to-all's expert layout, so every expert GEMM reduces
over the same rows in the same order. One spawn of two ranks trains both for 5 steps.

``--moe.grouped-gemm {torch,triton,cute}`` reaches ``GroupedExperts.gemm``: the flag parses,
``torch`` is today's path, ``triton`` trains like it (on CPU under Triton's interpreter, in a
child process), and what cannot run (triton: no CUDA device; cute: no SM90 / SM100 GPU, not
bf16, or the app's dropless layers) is one clear error before any work.
"""

from __future__ import annotations

import pytest
import torch

from titan_testing import run_distributed
from titan_train.build import resolve
from titan_train.cli import parse_config
from titan_train.trainer import train

STEPS = 5
EP2 = [
    "--model.family", "qwen3_moe", "--parallel.dp-shard", "2", "--parallel.ep", "2",
    "--training.steps", str(STEPS), "--training.batch-size", "4", "--training.seq-len", "64",
    "--lr-schedule.warmup-steps", "2", "--metrics.validate-every", "0",
    "--metrics.no-tensorboard", "--metrics.log-every", "5", "--metrics.peak-flops", "1e11",
    "--checkpoint.interval", "0",
]  # fmt: skip


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if hasattr(p, "to_local") else p).detach().clone()


def _train_both_dispatchers(out: str) -> dict[str, tuple[list[float], dict[str, torch.Tensor]]]:
    got = {}
    for dispatch in ("all_to_all", "symm_mem"):
        argv = ["--output-dir", out, "--name", dispatch, *EP2, "--moe.dispatch", dispatch]
        result = train(parse_config(argv))
        params = {n: _local(p) for n, p in result["model"].named_parameters()}
        got[dispatch] = (result["losses"], params)
    return got


@pytest.mark.slow  # two 5-step runs in one spawn: ~45 s on the shared 2-core machine
@pytest.mark.extended  # test_parallel.py (fast suite) checks the losses bitwise over 10 steps
def test_symm_mem_dispatch_trains_bitwise_like_all_to_all(tmp_path):
    for rank, got in enumerate(run_distributed(_train_both_dispatchers, 2, str(tmp_path))):
        (a2a_losses, a2a_params), (symm_losses, symm_params) = got["all_to_all"], got["symm_mem"]
        assert len(a2a_losses) == STEPS and symm_losses == a2a_losses, (symm_losses, a2a_losses)
        assert any(".experts." in n for n in a2a_params) and a2a_params.keys() == symm_params.keys()
        for name, value in a2a_params.items():  # every weight this rank holds, after 5 steps
            assert torch.equal(symm_params[name], value), f"rank {rank}: {name}"


def _resolve(*argv: str):
    return resolve(parse_config(["--model.family", "qwen3_moe", *argv]))


def test_grouped_gemm_flag_parses_and_torch_is_todays_path():
    from titan_train.build import build_model

    assert parse_config([]).moe.grouped_gemm == "torch"
    job = _resolve("--moe.grouped-gemm", "torch")
    model = build_model(job, torch.device("cpu"))
    experts = [m.experts for m in model.modules() if hasattr(m, "dispatcher")]
    assert experts and all(e.gemm == "torch" for e in experts)


def test_grouped_gemm_refuses_what_cannot_run_with_one_clear_error(capsys, monkeypatch):
    with pytest.raises(SystemExit):  # the CLI names the field, the value and the choices
        parse_config(["--moe.grouped-gemm", "cublas"])
    err = capsys.readouterr().err
    assert "cublas" in err and "torch" in err and "cute" in err
    cfg = parse_config(["--model.family", "qwen3_moe"])
    cfg.moe.grouped_gemm = "cublas"  # pyrefly: ignore[bad-assignment]  # a typed config bypassed
    with pytest.raises(ValueError, match=r"moe.grouped_gemm='cublas' must be 'torch', 'triton'"):
        resolve(cfg)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"moe.grouped_gemm='triton' needs a CUDA device; "):
        _resolve("--moe.grouped-gemm", "triton")  # training.device auto: the CPU here
    with pytest.raises(ValueError, match=r"SM90 \(Hopper\) or SM100 \(Blackwell\).*no CUDA"):
        _resolve("--moe.grouped-gemm", "cute")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    with pytest.raises(ValueError, match="this one is sm_80"):
        _resolve("--moe.grouped-gemm", "cute")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    with pytest.raises(ValueError, match="dropless"):
        _resolve("--moe.grouped-gemm", "cute", "--training.mixed-precision", "bf16")


TINY = [
    "--training.steps", "2", "--training.batch-size", "2", "--training.seq-len", "32",
    "--metrics.validate-every", "0", "--metrics.no-tensorboard", "--metrics.log-every", "1",
    "--metrics.peak-flops", "1e11", "--checkpoint.interval", "0", "--training.device", "cpu",
]  # fmt: skip


def _train_both_gemms(out: str) -> dict[str, tuple[list[float], list[str]]]:
    got = {}
    for gemm in ("torch", "triton"):
        argv = ["--output-dir", out, "--name", gemm, *TINY, "--moe.grouped-gemm", gemm]
        result = train(parse_config(argv, "qwen3_moe_debug"))
        kernels = [m.experts.gemm for m in result["model"].modules() if hasattr(m, "dispatcher")]
        got[gemm] = (result["losses"], kernels)
    return got


def test_grouped_gemm_triton_trains_like_torch_under_the_interpreter(tmp_path):
    """Two steps of qwen3_moe_debug each way (~25 s): every MoE layer runs the Triton
    kernels, and the losses agree within fp32 tolerance (1e-5)."""
    [got] = run_distributed(
        _train_both_gemms,
        1,
        str(tmp_path),
        init_process_group=False,
        env={"TRITON_INTERPRET": "1"},
        timeout=300,
    )
    (torch_losses, torch_kernels), (triton_losses, triton_kernels) = got["torch"], got["triton"]
    assert torch_kernels and set(torch_kernels) == {"torch"}
    assert len(triton_kernels) == len(torch_kernels) and set(triton_kernels) == {"triton"}
    assert len(triton_losses) == 2
    assert triton_losses == pytest.approx(torch_losses, abs=1e-5, rel=0)
