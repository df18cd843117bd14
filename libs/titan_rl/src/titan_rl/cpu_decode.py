"""CPU-only opt-in for compiled decoding: the linears of a decode step as products and sums.

At decode a linear multiplies a few rows (the batch) by a whole weight matrix. On a CPU a
GEMM library gains little from its threads at M = 8 and runs each linear as its own call;
written as ``(x[:, None, :] * W).sum(-1)`` and traced into the compiled step, Inductor emits
one vectorised dot-product loop per linear that splits the weight rows over the threads and
fuses with the norm, activation and residual around it. On an accelerator the vendor GEMM is
the right kernel, so this is never a default: ``TorchGenerator(compile_decode=True,
cpu_rowwise_linear=True)`` turns it on, for a model on the CPU only. Measured gain: the
README's decoding table (``benchmarks/decode_vs_transformers.py``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class RowwiseLinear(TorchFunctionMode):
    """While active and while ``torch.compile`` traces, ``F.linear`` over ``min_rows`` to
    ``max_rows`` rows is traced as products and sums (any other call is left alone). Eagerly
    it would materialise the ``(M, N, K)`` product, so it only acts under tracing."""

    def __init__(self, min_rows: int = 2, max_rows: int = 32) -> None:
        if not 1 <= min_rows <= max_rows:
            raise ValueError(
                f"RowwiseLinear needs 1 <= min_rows <= max_rows, got {min_rows}, {max_rows}"
            )
        super().__init__()
        self.min_rows, self.max_rows = min_rows, max_rows

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.linear and torch.compiler.is_compiling():
            x, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            x_MK = x.reshape(-1, x.shape[-1])
            if self.min_rows <= x_MK.shape[0] <= self.max_rows:
                out_MN = (x_MK[:, None, :] * weight).sum(-1)
                out_MN = out_MN if bias is None else out_MN + bias
                return out_MN.view(*x.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)
