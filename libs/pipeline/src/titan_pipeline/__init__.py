"""Pipeline schedules as data: generator, validator, simulator and runtime."""

from titan_pipeline.actions import Action, ActionKind, Schedule
from titan_pipeline.measurement import TimelineRecorder, measure_costs
from titan_pipeline.runtime import run, split_microbatches
from titan_pipeline.schedules import (
    SCHEDULES,
    STAGES_PER_RANK,
    add_communication,
    build_schedule,
    stage_to_rank,
)
from titan_pipeline.simulator import (
    BubbleComparison,
    Costs,
    DeadlockError,
    Interval,
    Timeline,
    compare,
    simulate,
)
from titan_pipeline.splitting import balance, build_stages, split_units
from titan_pipeline.stage import PipelineStage
from titan_pipeline.validator import validate

__version__ = "0.1.0"

__all__ = [
    "SCHEDULES",
    "STAGES_PER_RANK",
    "Action",
    "ActionKind",
    "BubbleComparison",
    "Costs",
    "DeadlockError",
    "Interval",
    "PipelineStage",
    "Schedule",
    "Timeline",
    "TimelineRecorder",
    "__version__",
    "add_communication",
    "balance",
    "build_schedule",
    "build_stages",
    "compare",
    "measure_costs",
    "run",
    "simulate",
    "split_microbatches",
    "split_units",
    "stage_to_rank",
    "validate",
]
