"""MoE routing, grouped experts, expert-parallel dispatch (local, all-to-all, symmetric memory), Triton kernels."""

from dist_moe.cute_gemm import (
    cute_available,
    cute_codegen,
    cute_grouped_mm,
    cute_swiglu_experts,
)
from dist_moe.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher
from dist_moe.experts import (
    ExpertRun,
    GroupedExperts,
    GroupedGemm,
    SharedExperts,
    SwiGLU,
    grouped_mm_available,
)
from dist_moe.hf_interop import HFSparseMoeBlock, moe_from_hf_block, swap_hf_moe_blocks
from dist_moe.kernels import combine_rows, expert_histogram, permute_rows
from dist_moe.moe import MoE, MoEConfig, expert_parallel
from dist_moe.permute import (
    PermuteConfig,
    PermutePlan,
    permute,
    plan_permutation,
    unpermute,
    unpermute_and_combine,
)
from dist_moe.placement import ExpertPlacement
from dist_moe.router import (
    ExpertLoad,
    RouterConfig,
    RouterOutput,
    TopKRouter,
    expert_load,
    hash_expert_table,
    sequence_parallel_balance,
    update_expert_biases,
)
from dist_moe.symm_mem import SymmMemDispatcher
from dist_moe.token_split import TokenSplitDispatcher
from dist_moe.triton_gemm import triton_grouped_mm

__version__ = "0.1.0"

__all__ = [
    "AllToAllDispatcher",
    "Dispatcher",
    "ExpertLoad",
    "ExpertPlacement",
    "ExpertRun",
    "GroupedExperts",
    "GroupedGemm",
    "HFSparseMoeBlock",
    "LocalDispatcher",
    "MoE",
    "MoEConfig",
    "PermuteConfig",
    "PermutePlan",
    "RouterConfig",
    "RouterOutput",
    "SharedExperts",
    "SwiGLU",
    "SymmMemDispatcher",
    "TokenSplitDispatcher",
    "TopKRouter",
    "__version__",
    "combine_rows",
    "cute_available",
    "cute_codegen",
    "cute_grouped_mm",
    "cute_swiglu_experts",
    "expert_histogram",
    "expert_load",
    "expert_parallel",
    "grouped_mm_available",
    "hash_expert_table",
    "moe_from_hf_block",
    "permute",
    "permute_rows",
    "plan_permutation",
    "sequence_parallel_balance",
    "swap_hf_moe_blocks",
    "triton_grouped_mm",
    "unpermute",
    "unpermute_and_combine",
    "update_expert_biases",
]
