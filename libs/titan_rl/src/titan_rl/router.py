"""A router over generator replicas that is itself a ``Generator``.

Each replica is a serial mailbox (an actor, or a thread for in-process replicas): requests
and weight loads run in the order they were sent, so a request sent after a load runs at the
loaded version or newer. The router sends each ``generate`` to the live replica with the
least outstanding work (rows x max_new_tokens; ties go round-robin), and a replica that dies
(``ReplicaDiedError`` from its future: its process was killed) is logged and dropped, or
replaced by ``restart(index)`` loaded with the newest published weights, and its lost
requests are sent again to the others.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from .generator import Generation, Generator, SamplingParams

log = logging.getLogger(__name__)


class ReplicaDiedError(RuntimeError):
    """The replica's process is gone (its future reports a supervision failure)."""


class NoReplicasError(RuntimeError):
    """Every replica has died and none can be restarted."""


class Pending(Protocol):
    """A reply to come: ``result()`` blocks (``ReplicaDiedError`` if the replica died)."""

    def result(self) -> Any: ...


class Replica(Protocol):
    """One generator replica as the router sees it."""

    name: str

    def submit_generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: list[int], kwargs: dict
    ) -> Pending:
        """Queue a ``generate``; the result is ``(Generation, start_time, end_time)``."""
        ...

    def submit_load(self, weights: Any, version: int) -> Pending:
        """Queue a weight load: a state dict, or a ``weight_sync.SharedWeightsRef``."""
        ...

    def close(self) -> None:
        """Release the replica (its process or thread)."""
        ...


class LocalReplica:
    """A ``Generator`` in this process behind a one-thread mailbox (tests, one-process runs)."""

    def __init__(self, generator: Generator, name: str = "local") -> None:
        self.generator, self.name = generator, name
        self._mailbox = ThreadPoolExecutor(1, thread_name_prefix=f"titan_rl-{name}")

    def submit_generate(self, prompts, params, seeds, kwargs) -> Future:
        def run():
            start = time.time()
            out = self.generator.generate(prompts, params, seeds, **kwargs)
            return out, start, time.time()

        return self._mailbox.submit(run)

    def submit_load(self, weights: Any, version: int) -> Future:
        from .weight_sync import load_weights

        return self._mailbox.submit(load_weights, self.generator, weights, version)

    def close(self) -> None:
        self._mailbox.shutdown(wait=True)


class Router:
    """Least-outstanding-work routing over replicas (a ``titan_rl.Generator``)."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        *,
        restart: Callable[[int], Replica] | None = None,
        on_interval: Callable[[str, float, float, str], None] | None = None,
    ) -> None:
        """``restart(i)``: a fresh replica to replace dead replica ``i`` (None: drop it).
        ``on_interval(lane, start, end, what)``: each request's busy time on its replica."""
        if not replicas:
            raise ValueError("Router needs at least one replica")
        self._replicas: dict[int, Replica] = dict(enumerate(replicas))
        self._outstanding = dict.fromkeys(self._replicas, 0)
        self._restart, self.on_interval = restart, on_interval
        self._lock = threading.Condition()
        self._tie = itertools.count()
        self._latest: tuple[Any, int] | None = None  # newest weights, loaded into restarts
        self._loads: dict[int, list[tuple[int, Pending]]] = {}
        self.weight_version = 0
        """Version of the newest weights sent to every live replica."""
        self.deaths: list[str] = []
        """Names of the replicas that died, in order."""
        self.resent = 0
        """Requests sent again because their replica died before answering."""

    @property
    def num_live(self) -> int:
        """Replicas currently taking requests."""
        with self._lock:
            return len(self._replicas)

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int],
        **kwargs: Any,
    ) -> Generation:
        """Send to the least-loaded live replica; re-send if it dies before answering."""
        cost = len(prompts) * params.max_new_tokens
        while True:
            index, replica = self._pick(cost)
            try:
                out, start, end = replica.submit_generate(prompts, params, seeds, kwargs).result()
            except ReplicaDiedError as e:
                self._drop(index, replica, e)
                with self._lock:
                    self.resent += 1
                continue
            finally:
                with self._lock:
                    if index in self._outstanding:
                        self._outstanding[index] -= cost
            if self.on_interval is not None:
                self.on_interval(f"replica:{replica.name}", start, end, "generate")
            return out

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load ``state_dict`` into every live replica (through this process) and wait."""
        self.publish(dict(state_dict), version)
        self.wait_loaded(version)

    def publish(self, weights: Any, version: int) -> None:
        """Queue a load of ``weights`` at ``version`` on every live replica; returns once
        queued (requests sent after this run at ``version`` or newer)."""
        with self._lock:
            self._latest = (weights, version)
            loads = [(i, r.submit_load(weights, version)) for i, r in self._replicas.items()]
            self._loads.setdefault(version, []).extend(loads)
            self.weight_version = version

    def wait_loaded(self, version: int) -> None:
        """Wait until every replica that was sent ``version`` has loaded it (or died)."""
        with self._lock:
            loads = self._loads.pop(version, [])
            for old in [v for v in self._loads if v < version]:
                loads += self._loads.pop(old)
        for index, pending in loads:
            try:
                pending.result()
            except ReplicaDiedError as e:
                with self._lock:
                    replica = self._replicas.get(index)
                if replica is not None:
                    self._drop(index, replica, e)

    def close(self) -> None:
        """Close every live replica."""
        with self._lock:
            replicas, self._replicas = list(self._replicas.values()), {}
        if replicas:  # at once: stopping a process takes a while
            with ThreadPoolExecutor(len(replicas)) as pool:
                list(pool.map(lambda r: r.close(), replicas))

    def _pick(self, cost: int) -> tuple[int, Replica]:
        with self._lock:
            if not self._replicas:
                raise NoReplicasError(f"every generator replica died ({', '.join(self.deaths)})")
            index = min(self._outstanding, key=lambda i: (self._outstanding[i], next(self._tie)))
            self._outstanding[index] += cost
            return index, self._replicas[index]

    def _drop(self, index: int, replica: Replica, error: BaseException) -> None:
        with self._lock:
            if self._replicas.get(index) is not replica:
                return  # already handled by another request
            del self._replicas[index]
            del self._outstanding[index]
            self.deaths.append(replica.name)
            live = len(self._replicas)
        log.error(
            "generator replica %s died (%s); %s", replica.name, str(error).splitlines()[0],
            "restarting it" if self._restart else f"continuing on {live} replica(s)",
        )  # fmt: skip
        if self._restart is None:
            return
        fresh = self._restart(index)
        with self._lock:
            if self._latest is not None:
                weights, version = self._latest
                self._loads.setdefault(version, []).append(
                    (index, fresh.submit_load(weights, version))
                )
            self._replicas[index] = fresh
            self._outstanding[index] = 0
