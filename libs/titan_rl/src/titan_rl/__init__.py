"""RL post-training with the same model code in trainer and generator."""

from .batch_invariant import batch_invariant, invariant_attention, invariant_linear
from .buffer import RolloutRequest, WorkBuffer
from .causal_lm import CausalLM, causal_lm_logits
from .compaction import CompactionPolicy, DropToolOutputs, Summarize
from .controller import Controller, DataflowConfig, LocalPolicy, Policy, Timeline
from .diagnostics import logprob_diagnostics, reward_diagnostics
from .environment import (
    CodeToolEnv,
    Environment,
    Episode,
    StepResult,
    TokenSequence,
    episode_tensors,
)
from .generator import Generation, Generator, SamplingParams, TorchGenerator
from .learner import AllReduceGradients, DataParallel, GRPOLearner
from .logprobs import pack_sequences, sequence_logprobs, token_logprobs
from .loop import GRPOConfig, GRPOTrainer
from .loss_registry import PolicyLoss, get_loss, loss_names, register_loss
from .losses import (
    LossConfig,
    LossOutput,
    aggregate,
    correction_weights,
    group_advantages,
    grpo_loss,
)
from .messages import Message, ToolCall, as_message
from .packing import PackedRows, pack_rows, packed_sequence_logprobs
from .renderer import ChatTemplateRenderer, RenderedTokens, Renderer, SimpleChatRenderer
from .rewards import (
    RewardResult,
    boxed_math_reward,
    code_reward,
    exact_match_reward,
    last_boxed,
)
from .rollout import (
    Prompt,
    PromptImages,
    RolloutBatch,
    Task,
    batch_images,
    collect_rollouts,
    evaluate_accuracy,
    rollout_seed,
)
from .rollouter import RolloutConfig, Rollouter, run_episode, turn_seed
from .router import LocalReplica, NoReplicasError, ReplicaDiedError, Router
from .rubric import (
    RewardFunction,
    Rubric,
    RubricScore,
    environment_reward,
    shortest_correct_bonus,
)
from .sandbox import SandboxLimits, SandboxResult, SandboxUnavailableError, run_sandboxed
from .tasks import ExactMatchTask
from .tokenizer import Tokenizer
from .weight_sync import SharedWeights
from .workers import RolloutSource, TaskRollouts

__version__ = "0.1.0"

__all__ = [
    "AllReduceGradients",
    "CausalLM",
    "ChatTemplateRenderer",
    "CodeToolEnv",
    "CompactionPolicy",
    "Controller",
    "DataParallel",
    "DataflowConfig",
    "DropToolOutputs",
    "Environment",
    "Episode",
    "ExactMatchTask",
    "GRPOConfig",
    "GRPOLearner",
    "GRPOTrainer",
    "Generation",
    "Generator",
    "LocalPolicy",
    "LocalReplica",
    "LossConfig",
    "LossOutput",
    "Message",
    "NoReplicasError",
    "PackedRows",
    "Policy",
    "PolicyLoss",
    "Prompt",
    "PromptImages",
    "RenderedTokens",
    "Renderer",
    "ReplicaDiedError",
    "RewardFunction",
    "RewardResult",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutRequest",
    "RolloutSource",
    "Rollouter",
    "Router",
    "Rubric",
    "RubricScore",
    "SamplingParams",
    "SandboxLimits",
    "SandboxResult",
    "SandboxUnavailableError",
    "SharedWeights",
    "SimpleChatRenderer",
    "StepResult",
    "Summarize",
    "Task",
    "TaskRollouts",
    "Timeline",
    "TokenSequence",
    "Tokenizer",
    "ToolCall",
    "TorchGenerator",
    "WorkBuffer",
    "__version__",
    "aggregate",
    "as_message",
    "batch_images",
    "batch_invariant",
    "boxed_math_reward",
    "causal_lm_logits",
    "code_reward",
    "collect_rollouts",
    "correction_weights",
    "environment_reward",
    "episode_tensors",
    "evaluate_accuracy",
    "exact_match_reward",
    "get_loss",
    "group_advantages",
    "grpo_loss",
    "invariant_attention",
    "invariant_linear",
    "last_boxed",
    "logprob_diagnostics",
    "loss_names",
    "pack_rows",
    "pack_sequences",
    "packed_sequence_logprobs",
    "register_loss",
    "reward_diagnostics",
    "rollout_seed",
    "run_episode",
    "run_sandboxed",
    "sequence_logprobs",
    "shortest_correct_bonus",
    "token_logprobs",
    "turn_seed",
]
