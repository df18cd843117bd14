"""GRPO on Monarch actors: a trainer mesh, generator replicas, the controller in this process.

Needs ``torchmonarch`` (``pip install titan-rl[monarch]``); imported here only, so the rest
of titan_rl imports without it.

- **Trainer**: one proc mesh of ``trainer_ranks`` procs, one ``TrainerActor`` each. The ranks
  form their own torch.distributed group (gloo on CPU, NCCL on CUDA); each builds the model
  (``model_factory(device)``), makes it data parallel with the injected ``DataParallel``
  hook (the app passes flexshard), builds its optimizer (``optimizer_factory(params)``) and
  runs ``GRPOLearner.step`` on its share of every batch.
- **Generators**: each replica is its own proc mesh of one proc (a ``GeneratorActor`` over
  ``generator_factory(index)``), so a replica that dies takes no other with it. A ``Router``
  sends requests to them; a dead one is logged and restarted (or dropped), its requests sent
  again.
- **Weights**: every trainer rank writes the pieces it holds into a ``SharedWeights`` slot in
  ``/dev/shm``; the replicas copy the slot in place at its version. Only the small reference
  passes through the controller. (One host; across hosts a torch.distributed broadcast group
  would replace the file.)
- **Faults**: Monarch reports a dead proc as a ``SupervisionError`` from the pending call's
  ``get()`` and as an unhandled supervision event, whose default hook exits the controller.
  While a ``DistributedGRPO`` is open, that hook logs the event and returns (the failure is
  handled where the call fails): a dead replica is replaced, a dead trainer rank ends the
  run with one ``TrainerDiedError`` line.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import monarch.actor
import torch
import torch.distributed as dist
from monarch._rust_bindings.monarch_hyperactor.supervision import SupervisionError
from monarch.actor import Actor, ActorError, current_rank, current_size, endpoint, this_host
from torch import nn

from .controller import Controller, DataflowConfig
from .factories import TorchGeneratorFactory
from .generator import Generator
from .learner import DataParallel, GRPOLearner
from .loop import GRPOConfig
from .rollout import RolloutBatch
from .router import ReplicaDiedError, Router
from .weight_sync import SharedWeights, SharedWeightsRef, load_weights
from .workers import RolloutSource

log = logging.getLogger(__name__)

ModelFactory = Callable[[torch.device], nn.Module]
"""``model_factory(device)``: the initial policy on ``device`` (same weights on every rank)."""
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
GeneratorFactory = Callable[[int], Generator]
"""``generator_factory(index)``: replica ``index``'s generator (picks its own device)."""

__all__ = [
    "DistributedGRPO",
    "GeneratorActor",
    "MeshConfig",
    "MonarchReplica",
    "TorchGeneratorFactory",
    "TrainerActor",
    "TrainerDiedError",
    "TrainerMesh",
]


class TrainerDiedError(RuntimeError):
    """A trainer rank's process died: the run cannot continue."""


@dataclass(kw_only=True, slots=True)
class MeshConfig:
    """Where the trainer and the generators run."""

    num_generators: int = 1
    """Generator replicas (one process each)."""
    trainer_ranks: int = 1
    """Data-parallel trainer ranks (one process each)."""
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """The trainer group's backend; auto: NCCL where CUDA is available, else gloo."""
    num_threads: int = 0
    """Intra-op threads of each actor process (0: leave torch's default)."""
    restart_generators: bool = True
    """Replace a dead replica (True) or go on with the others (False)."""
    weights_dir: str = "/dev/shm"
    """Where the shared weight slots live (a RAM-backed file system on the host)."""

    def __post_init__(self) -> None:
        if self.num_generators < 1:
            raise ValueError(f"MeshConfig.num_generators={self.num_generators} must be >= 1")
        if self.trainer_ranks < 1:
            raise ValueError(f"MeshConfig.trainer_ranks={self.trainer_ranks} must be >= 1")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"MeshConfig.backend={self.backend!r} must be auto, gloo or nccl")
        if self.num_threads < 0:
            raise ValueError(f"MeshConfig.num_threads={self.num_threads} must be >= 0")
        if not os.path.isdir(self.weights_dir):
            raise ValueError(f"MeshConfig.weights_dir={self.weights_dir!r} is not a directory")


class TrainerActor(Actor):
    """One data-parallel trainer rank."""

    def __init__(
        self,
        model_factory: ModelFactory,
        optimizer_factory: OptimizerFactory,
        data_parallel: DataParallel,
        config: GRPOConfig,
        address: tuple[str, int],
        backend: str,
        num_threads: int,
    ) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.rank, self.world = current_rank()["procs"], current_size()["procs"]
        dist.init_process_group(
            backend,
            init_method=f"tcp://{address[0]}:{address[1]}",
            rank=self.rank,
            world_size=self.world,
        )
        device = torch.device(f"cuda:{self.rank}" if backend == "nccl" else "cpu")
        world_group = dist.group.WORLD
        assert world_group is not None  # set by init_process_group above
        model = data_parallel.parallelize(model_factory(device), world_group)
        self.dp = data_parallel
        self.learner = GRPOLearner(
            model,
            optimizer_factory(model.parameters()),
            config,
            group=dist.group.WORLD,
            data_parallel=data_parallel,
        )

    @endpoint
    def layout(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every weight's full shape and dtype (what the shared slots hold)."""
        out = {}
        for name, value in self.dp.state_dict(self.learner.model).items():
            shape = value.global_shape if hasattr(value, "global_shape") else value.shape
            out[name] = (tuple(shape), value.dtype)
        return out

    @endpoint
    def step(self, batch: RolloutBatch, max_lag: int) -> dict[str, Any]:
        """``GRPOLearner.step`` on this rank's share of ``batch``."""
        return self.learner.step(batch, max_lag=max_lag)

    @endpoint
    def publish(self, shared: SharedWeights, version: int) -> None:
        """Write this rank's pieces into ``version``'s slot; rank 0 stamps it when all have."""
        if version != self.learner.version:
            raise ValueError(f"publish({version}) at trainer version {self.learner.version}")
        shared.write(version, self.dp.state_dict(self.learner.model), self.rank, self.world)
        dist.barrier()
        if self.rank == 0:
            shared.stamp(version)

    @endpoint
    def set_version(self, version: int) -> None:
        """Resume: the weights loaded (by ``run``) are of ``version``."""
        self.learner.version = version

    @endpoint
    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(learner, *args)`` on every rank (checkpoint save / load, inspection)."""
        return fn(self.learner, *args)

    @endpoint
    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class GeneratorActor(Actor):
    """One generator replica."""

    def __init__(self, generator_factory: GeneratorFactory, index: int, num_threads: int) -> None:
        if num_threads:
            torch.set_num_threads(num_threads)
        self.generator = generator_factory(index)

    @endpoint
    def generate(self, prompts, params, seeds, kwargs) -> tuple[Any, float, float]:
        start = time.time()
        out = self.generator.generate(prompts, params, seeds, **kwargs)
        return out, start, time.time()

    @endpoint
    def load(self, weights: Any, version: int) -> None:
        load_weights(self.generator, weights, version)

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    @endpoint
    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(generator, *args)`` in the replica (inspection, tests)."""
        return fn(self.generator, *args)


class _Reply:
    """A Monarch future as the router's ``Pending``: a dead process is ``ReplicaDiedError``."""

    def __init__(self, future: Any, name: str) -> None:
        self.future, self.name = future, name

    def result(self) -> Any:
        try:
            return self.future.get()
        except SupervisionError as e:
            raise ReplicaDiedError(f"replica {self.name}: {e}") from e
        except ActorError as e:  # the generator raised: a bug or bad input, not a death
            raise RuntimeError(f"replica {self.name} failed: {e.exception}") from e


class MonarchReplica:
    """A generator replica in its own proc mesh (a ``router.Replica``)."""

    def __init__(self, generator_factory: GeneratorFactory, index: int, num_threads: int) -> None:
        self.name = f"gen{index}"
        self.procs = this_host().spawn_procs(per_host={"procs": 1})
        self.actor = self.procs.spawn(
            f"generator{index}", GeneratorActor, generator_factory, index, num_threads
        )

    def submit_generate(self, prompts, params, seeds, kwargs) -> _Reply:
        return _Reply(self.actor.generate.call_one(prompts, params, seeds, kwargs), self.name)

    def submit_load(self, weights: Any, version: int) -> _Reply:
        return _Reply(self.actor.load.call_one(weights, version), self.name)

    def pid(self) -> int:
        return _Reply(self.actor.pid.call_one(), self.name).result()

    def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return _Reply(self.actor.run.call_one(fn, *args), self.name).result()

    def close(self) -> None:
        try:
            self.procs.stop().get()
        except Exception as e:  # already dead: nothing left to stop
            log.debug("stopping replica %s: %s", self.name, e)


class TrainerMesh:
    """The trainer ranks as the controller's ``Policy``."""

    reuses_slots = True

    def __init__(self, procs: Any, actor: Any, shared: SharedWeights | None) -> None:
        self.procs, self.actor, self.shared = procs, actor, shared
        self.version = 0

    def train(self, batch: RolloutBatch, max_lag: int) -> dict[str, Any]:
        metrics = self._all(self.actor.step.call(batch, max_lag)).item(procs=0)
        self.version += 1
        return metrics

    def publish(self, version: int) -> SharedWeightsRef:
        if self.shared is None:
            raise RuntimeError("TrainerMesh.publish: no shared weights to publish to")
        self._all(self.actor.publish.call(self.shared, version))
        return self.shared.ref(version)

    def set_version(self, version: int) -> None:
        self._all(self.actor.set_version.call(version))
        self.version = version

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(learner, *args)`` on every rank; the results in rank order."""
        values = self._all(self.actor.run.call(fn, *args))
        return [values.item(procs=r) for r in range(len(values))]

    def _all(self, future: Any) -> Any:
        try:
            return future.get()
        except SupervisionError as e:
            first = str(e).strip().splitlines()[-1].strip()
            raise TrainerDiedError(f"a trainer rank died, the run stops: {first}") from None

    def close(self) -> None:
        try:
            self.actor.close.call().get()
            self.procs.stop().get()
        except Exception as e:  # a dead rank: its mesh is already going
            log.debug("stopping the trainer mesh: %s", e)


class DistributedGRPO:
    """GRPO with a trainer mesh and generator replicas (a context manager).

    ```python
    with DistributedGRPO(model_factory=..., optimizer_factory=..., generator_factory=...,
                         data_parallel=..., source=..., config=grpo, mesh=MeshConfig(...)) as rl:
        history = rl.train(100, on_step=log_metrics)
    ```
    """

    def __init__(
        self,
        *,
        model_factory: ModelFactory,
        optimizer_factory: OptimizerFactory,
        generator_factory: GeneratorFactory,
        data_parallel: DataParallel,
        source: RolloutSource,
        config: GRPOConfig,
        mesh: MeshConfig | None = None,
        dataflow: DataflowConfig | None = None,
    ) -> None:
        """All factories and the hook must be picklable (they travel to the actors)."""
        for name, fn in (
            ("model_factory", model_factory),
            ("optimizer_factory", optimizer_factory),
            ("generator_factory", generator_factory),
            ("source", source),
        ):
            if not callable(fn):
                raise TypeError(f"DistributedGRPO: {name} must be callable, got {fn!r}")
        if not isinstance(data_parallel, DataParallel):
            raise TypeError(
                f"DistributedGRPO: data_parallel must implement titan_rl.learner.DataParallel "
                f"(parallelize, reduce_gradients, clip_grad_norm_, state_dict), got {data_parallel!r}"
            )
        self.mesh = mesh or MeshConfig()
        self.dataflow = dataflow or DataflowConfig(rollout_workers=2 * self.mesh.num_generators)
        self._args = (model_factory, optimizer_factory, generator_factory, data_parallel, source)
        self.config = config
        self.trainer: TrainerMesh | None = None
        self.router: Router | None = None
        self.controller: Controller | None = None
        self.shared: SharedWeights | None = None
        self._hook: Any = None
        self._replicas: list[MonarchReplica] = []

    def __enter__(self) -> DistributedGRPO:
        model_factory, optimizer_factory, generator_factory, data_parallel, source = self._args
        m = self.mesh
        self._hook = monarch.actor.unhandled_fault_hook
        monarch.actor.unhandled_fault_hook = _log_failure
        try:
            backend = m.backend
            if backend == "auto":
                backend = "nccl" if torch.cuda.is_available() else "gloo"
            procs = this_host().spawn_procs(per_host={"procs": m.trainer_ranks})
            actor = procs.spawn(
                "trainer", TrainerActor, model_factory, optimizer_factory, data_parallel,
                self.config, ("127.0.0.1", _free_port()), backend, m.num_threads,
            )  # fmt: skip
            self.trainer = TrainerMesh(procs, actor, None)

            def spawn(index: int) -> MonarchReplica:
                return MonarchReplica(generator_factory, index, m.num_threads)

            # Spawning is asynchronous: the replicas start while the trainer ranks build.
            replicas = [spawn(i) for i in range(m.num_generators)]
            self._replicas = replicas
            layout = self.trainer._all(actor.layout.call()).item(procs=0)
            self.shared = self.trainer.shared = SharedWeights.create(layout, m.weights_dir)
            self.router = Router(replicas, restart=spawn if m.restart_generators else None)
            self.controller = Controller(
                self.trainer, self.router, source, self.config, self.dataflow
            )
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def train(
        self, num_steps: int, *, on_step: Callable[[dict[str, Any]], bool | None] | None = None
    ) -> list[dict[str, Any]]:
        """``num_steps`` steps of the controller; each step's metrics."""
        if self.controller is None:
            raise RuntimeError("DistributedGRPO.train outside its `with` block")
        return self.controller.run(num_steps, on_step=on_step)

    def state_dict(self) -> dict[str, Any]:
        """The controller's state (the trainer's weights are checkpointed by ``trainer.run``)."""
        if self.controller is None:
            raise RuntimeError("DistributedGRPO.state_dict outside its `with` block")
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the controller (after loading the trainer's weights of that version)."""
        if self.controller is None or self.trainer is None:
            raise RuntimeError("DistributedGRPO.load_state_dict outside its `with` block")
        self.trainer.set_version(int(state["version"]))
        self.controller.load_state_dict(state)

    def close(self) -> None:
        """Stop every actor, remove the weight slots, restore Monarch's fault hook."""
        if self.router is not None:
            self.router.close()
        elif self._replicas:  # failed before the router existed
            for r in self._replicas:
                r.close()
        self._replicas = []
        if self.trainer is not None:
            self.trainer.close()
        if self.shared is not None:
            self.shared.unlink()
        self.router = self.trainer = self.shared = self.controller = None
        if self._hook is not None:
            monarch.actor.unhandled_fault_hook = self._hook
            self._hook = None


def _log_failure(failure: Any) -> None:
    # Handled where the pending call fails (router: restart; trainer: TrainerDiedError).
    log.warning("Monarch supervision event: %s", str(failure).splitlines()[0])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
