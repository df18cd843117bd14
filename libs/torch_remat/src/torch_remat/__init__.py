"""Fine-grained activation rematerialisation: policies, regions, CPU offload, memory-budget planner."""

from .checkpoint import checkpoint
from .fqn import fqn_matches
from .measure import Measurement, measure
from .planner import Plan, PlanRow, plan
from .policies import OP_GROUPS, Budget, EveryNth, Full, Offload, Policy, Selective, UnitPolicies
from .region import region
from .units import apply, remove

__version__ = "0.1.0"

__all__ = [
    "OP_GROUPS",
    "Budget",
    "EveryNth",
    "Full",
    "Measurement",
    "Offload",
    "Plan",
    "PlanRow",
    "Policy",
    "Selective",
    "UnitPolicies",
    "__version__",
    "apply",
    "checkpoint",
    "fqn_matches",
    "measure",
    "plan",
    "region",
    "remove",
]
