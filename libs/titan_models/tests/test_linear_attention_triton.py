"""The Triton kernels of the chunked delta rule equal the torch chunked form, forward and every
gradient: on CPU under TRITON_INTERPRET=1, on CUDA natively.

TRITON_INTERPRET must be set before triton is first imported, so the CPU checks run in a
fresh child process (``run_distributed(..., init_process_group=False, env=...)``). Shapes are
tiny (the interpreter runs the kernels in numpy, one program at a time).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from titan_testing import requires_gpus, run_distributed

TOL = 1e-5


def _compare(device: str, cases: list[tuple[bool, bool, int, int]]) -> dict[str, float]:
    """Max |triton - torch| over the outputs and gradients of each case
    ``(per_channel, documents, seq_len, chunk)``."""
    from titan_models.components.linear_attention import chunk_delta_rule

    out = {}
    for per_channel, documents, S, C in cases:
        g = torch.Generator().manual_seed(S)
        B, H, K, V = 2, 2, 8, 12  # K, V below the 16-wide tiles: the masks are exercised
        q = torch.randn(B, S, H, K, generator=g)
        k = F.normalize(torch.randn(B, S, H, K, generator=g), dim=-1)
        v = torch.randn(B, S, H, V, generator=g)
        decay = -torch.rand((B, S, H, K) if per_channel else (B, S, H), generator=g)
        beta, state = torch.rand(B, S, H, generator=g), torch.randn(B, H, K, V, generator=g)
        ids = None
        if documents:
            ids = torch.zeros(B, S, dtype=torch.long)
            ids[0, 7:] = 1
            ids[0, S - 3 :] = 2  # a document inside a chunk, one across chunks
        inputs = [t.to(device) for t in (q, k, v, decay, beta, state)]
        w_o, w_s = torch.randn(B, S, H, V, generator=g), torch.randn(B, H, K, V, generator=g)
        results = {}
        for backend in ("torch", "triton"):
            xs = [t.detach().clone().requires_grad_() for t in inputs]
            o, final = chunk_delta_rule(
                *xs[:5],
                scale=0.3,
                chunk_size=C,
                initial_state=xs[5],
                document_ids=None if ids is None else ids.to(device),
                output_final_state=True,
                backend=backend,
            )
            ((o * w_o.to(device)).sum() + (final * w_s.to(device)).sum()).backward()
            results[backend] = [o, final, *(x.grad for x in xs)]
        name = f"{'channel' if per_channel else 'head'}{'+docs' if documents else ''} S={S} C={C}"
        for what, a, b in zip(
            ["o", "final", "dq", "dk", "dv", "dg", "dbeta", "dstate"],
            results["triton"],
            results["torch"],
            strict=True,
        ):
            out[f"{name} {what}"] = (a.double() - b.double()).abs().max().item()
    return out


def _interpret(cases) -> dict[str, float]:
    [res] = run_distributed(
        _compare,
        1,
        "cpu",
        cases,
        init_process_group=False,
        env={"TRITON_INTERPRET": "1"},
        timeout=600,
    )
    return res


def _assert_close(res: dict[str, float], cases: int) -> None:
    assert len(res) == 8 * cases
    for name, err in res.items():
        assert err <= TOL, f"{name}: {err}"


def test_triton_kernels_equal_the_torch_chunked_form_under_the_interpreter():
    # Per-head decays with documents over two chunks and a padded third; one per-channel case.
    _assert_close(_interpret([(False, True, 40, 16), (True, False, 20, 16)]), 2)


@pytest.mark.slow
@pytest.mark.extended  # the fast suite runs a subset of the variants
def test_triton_kernels_equal_the_torch_chunked_form_for_every_variant_under_the_interpreter():
    cases = [(pc, docs, 45, 16) for pc in (False, True) for docs in (False, True)]
    _assert_close(_interpret([*cases, (True, True, 70, 32)]), 5)


@pytest.mark.gpu
@requires_gpus(1)
def test_triton_kernels_equal_the_torch_chunked_form_on_cuda():
    cases = [(pc, docs, S, 64) for pc in (False, True) for docs in (False, True) for S in (64, 300)]
    _assert_close(_compare("cuda", cases), len(cases))


def test_backend_choice_is_checked():
    from titan_models.components.linear_attention.triton_kernels import resolve_backend

    assert resolve_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_backend("torch", torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="must be one of"):
        resolve_backend("flash", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            resolve_backend("triton", torch.device("cpu"))
