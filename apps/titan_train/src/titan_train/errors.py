"""The app's own errors: each ends the job with one clear line (``titan-train: error: ...``)."""

from __future__ import annotations


class ConfigError(ValueError):
    """The job cannot start with this config or run folder; raised before anything is
    written."""


class NonFiniteError(RuntimeError):
    """Training produced a non-finite loss or gradient norm; the message names the step."""


class ExportError(RuntimeError):
    """The HF export of a trained model failed; the message says where the weights are."""


class FaultToleranceError(RuntimeError):
    """A replica group of a fault-tolerant job cannot go on (no lighthouse, no quorum within
    the timeout); the message names the replica and the address."""


class NoPeerToRejoin(RuntimeError):
    """A restarted replica group found no live peer to heal from: the others have finished."""
