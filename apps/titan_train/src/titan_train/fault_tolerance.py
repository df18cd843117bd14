"""Fault-tolerant replica groups through torchft: a lost group is dropped from the next step,
a restarted one heals from a live peer; or DiLoCo, semi-synchronous, on the same groups.

Each replica group is a job of its own: its ranks (torchrun, or one process), its process
group, inside which flexshard shards the model over ``dp_shard x cp``, and its run folder
``<output_dir>/<name>/replica-<id>`` (checkpoints, metrics). Across the groups, torchft does
the rest: a ``Manager`` on every rank (rank 0 of a group runs torchft's manager server, which
heartbeats to the lighthouse), a reconfigurable ``ProcessGroupGloo`` between the ranks of the
same group rank (the replicate axis of HSDP), and torchft's HTTP transport for healing.

One step (``sync_steps=1``): a quorum (``Manager.start_quorum``, synchronous: a group that
rejoins is healed before its forward), the target-token count summed over the live groups
(the loss scale: the gradient of the mean over every live token, exactly as HSDP's), the
gradients summed over the live groups and divided by their number (one all-reduce per
dtype, the loss folded in), then torchft's commit vote (``should_commit``): every group steps
its optimizer, or the step is discarded and runs again with the same batch and a new quorum.
Without a failure the arithmetic is HSDP's: the same sums, divided by the same powers of two.

Healing: a group behind the quorum's step receives a live peer's weights, optimizer state,
schedule, step and the table of batches every group has consumed in committed steps
(``Manager.register_state_dict_fn``); no checkpoint is read. Its loader skips exactly the
batches it trained before it died, so no sample is trained twice or skipped.

DiLoCo (``sync_steps=H > 1``): torchft's ``DiLoCo`` on the group's model: H inner optimizer
steps with no cross-group traffic, then one quorum and one all-reduce of the pseudo-gradient
(the change since the last sync), and an outer Nesterov SGD step on it. A restarted group
heals at the next sync; its data goes on from its own checkpoint.

Checkpoints: each group saves its own (``checkpoint_item``: the consumed-batch table, the
torchft step and, under DiLoCo, the last synced weights and the outer optimizer), so a
resume after a full stop is bitwise the run that was stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import signal
import socket
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from titan_train.config import JobConfig
from titan_train.errors import FaultToleranceError, NoPeerToRejoin

os.environ.setdefault("RUST_LOG", "warn")  # torchft's Rust side logs every quorum tick at info

RESTART_ENV = "TITAN_FT_RESTART"
"""Set by the local launcher on a restarted replica group: how many times it restarted."""
REJOIN_ENV = "TITAN_FT_REJOIN"
"""Set (``1``) by the local launcher on a restarted group that has live peers to heal from:
a first quorum with no peer means they have finished (``NoPeerToRejoin``)."""
FAULT_ENV = "TITAN_FT_FAULT"
"""Fault injection for tests, ``<replica>:<step>``: every rank of that replica group kills
itself (SIGKILL) in that step, after its backward; first incarnation only."""
HEAL_CHECK_ENV = "TITAN_FT_HEAL_CHECK"
"""Tests: ``1``: after the first step that follows a heal, the healed group and the group it
healed from save their weights and optimizer state (``heal-check-step-<s>-rank-<r>.pt`` in
their run folders), to be compared."""


def replica_config(cfg: JobConfig) -> JobConfig:
    """With fault tolerance on, the config of this replica group's own run folder
    (``<output_dir>/<name>/replica-<id>``); unchanged otherwise (and when already applied)."""
    ft = cfg.fault_tolerance
    folder = f"replica-{ft.replica_id}"
    if not ft.enable or cfg.name == folder:
        return cfg
    return dataclasses.replace(cfg, output_dir=str(Path(cfg.output_dir) / cfg.name), name=folder)


def data_shard(cfg: JobConfig, pm: Any) -> tuple[int, int]:
    """(rank, size) of this rank's data shard: with fault tolerance, the ranks of replica
    group ``i`` read shards ``i*dp .. i*dp + dp - 1`` of ``group_size * dp`` (HSDP's order)."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return pm.dp_rank, pm.dims.dp
    return ft.replica_id * pm.dims.dp + pm.dp_rank, ft.group_size * pm.dims.dp


def outer_optimizer(params: Sequence[torch.Tensor], ft: Any) -> torch.optim.Optimizer:
    """DiLoCo's outer optimizer: SGD on the averaged pseudo-gradient with
    ``fault_tolerance.outer_lr`` and ``outer_momentum`` (Nesterov when the momentum is > 0;
    momentum 0 and lr 1 is plain averaging of the groups' weights)."""
    momentum = ft.outer_momentum
    return torch.optim.SGD(params, lr=ft.outer_lr, momentum=momentum, nesterov=momentum > 0)


class FaultTolerance:
    """One rank's side of a fault-tolerant job: what ``train_step`` and the loop call.

    ``next_batch`` (quorum, healing, this group's batch), ``sync_tokens`` and ``sync_grads``
    (the cross-group sums), ``should_commit`` (the vote: ``committed`` says whether the step
    counts), ``metrics`` and ``close``. Built before the resume (``checkpoint_item``), it
    reaches the lighthouse at the first ``next_batch``."""

    def __init__(
        self,
        cfg: JobConfig,
        pm: Any,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loader: Any,
        state: Any,
        run_dir: Path,
    ) -> None:
        ft = cfg.fault_tolerance
        self.cfg, self.pm, self.optimizer, self.scheduler = cfg, pm, optimizer, scheduler
        self.loader, self.state, self.run_dir = loader, state, run_dir
        self.replica_id, self.sync_steps = ft.replica_id, ft.sync_steps
        self.rank = dist.get_rank() if pm.dims.world_size > 1 else 0
        self.consumed = torch.zeros(ft.group_size, dtype=torch.int64)
        """Batches each replica group has consumed in committed steps (DiLoCo: this group's
        inner steps)."""
        self.committed = True
        self.heals = self.syncs = self.discarded = 0
        self.manager: Any = None
        self.diloco: Any = None
        self._batch: Any = None  # the step's batch, kept until the step commits
        self._live: list[int] | None = None
        self._quorum_id = -1
        self._manager_step = 0
        self._local_step = 0
        self._resumed = False
        self._rejoin = os.environ.get(REJOIN_ENV) == "1"
        self._store: Any = None
        self._log_handler: logging.Handler | None = None
        self._check_next = False  # HEAL_CHECK_ENV: a heal in this step's quorum
        self._check_step: int | None = None
        self.outer: torch.optim.Optimizer | None = None
        self._backup: dict[str, torch.Tensor] = {}
        if self.sync_steps > 1:
            named = [(n, p) for n, p in pm.parts[0].named_parameters()]
            params = [p for _, p in named if p.requires_grad]
            self.outer = outer_optimizer(params, ft)
            self._backup = {n: _local(p).detach().clone() for n, p in named}

    # --- checkpoints ----------------------------------------------------------------------

    def checkpoint_items(self) -> dict[str, Any]:
        """What this group's checkpoints hold besides the job's own items (per rank)."""
        items: dict[str, Any] = {"ft": _State(self)}
        if self.outer is not None:
            items["ft_outer_optim"] = self.outer
        if self.pm.dims.world_size == 1:
            return items
        from torch_checkpointing import PerRank

        return {k: PerRank(v) for k, v in items.items()}

    # --- the step -------------------------------------------------------------------------

    def next_batch(self) -> Any:
        """This step's batch (on the host): after a quorum (a group behind it is healed
        first), and the same batch again after a discarded step."""
        if self.manager is None:
            self._start()
        if self._check_step is not None:
            self._save_heal_check()
        if self.sync_steps == 1:
            self._quorum()
        else:
            self._fault_point()
        if self._batch is None:
            self._batch = next(self.loader)
        return self._batch

    def sync_tokens(self, num_tokens: torch.Tensor) -> int:
        """Sum ``num_tokens`` over the live groups in place; their number (1 under DiLoCo,
        whose groups step alone between syncs)."""
        if self.sync_steps > 1:
            return 1
        from torch.distributed import ReduceOp

        self.manager.allreduce(num_tokens, reduce_op=ReduceOp.SUM).wait()
        return self.manager.num_participants()

    def sync_grads(self, params: Sequence[torch.Tensor], total: torch.Tensor) -> None:
        """Average the gradients of ``params`` over the live groups and sum ``total`` (this
        rank's loss share): one all-reduce per dtype, the loss in the first. A failure is
        recorded by torchft and the step's commit vote fails."""
        if self.sync_steps > 1:
            return
        self._fault_point()
        from torch.distributed import ReduceOp

        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if not p.requires_grad:
                continue
            if p.grad is None:  # unused this step: zeros, so every group's buffer agrees
                p.grad = torch.zeros_like(p)
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        live = self.manager.num_participants()
        loss_done = False
        for dtype, grads in by_dtype.items():
            parts = [g.reshape(-1) for g in grads]
            with_loss = not loss_done and dtype == total.dtype
            flat = torch.cat([*parts, total.reshape(1)] if with_loss else parts)
            self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
            n = flat.numel() - int(with_loss)
            flat[:n].div_(live)  # torchft's own average (ReduceOp.AVG): the sum, then /= live
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
            if with_loss:
                total.copy_(flat[-1])
                loss_done = True
        if not loss_done:
            self.manager.allreduce(total, reduce_op=ReduceOp.SUM).wait()
        self.syncs += 1

    def should_commit(self) -> bool:
        """torchft's vote on this step (every rank of every live group agrees); under DiLoCo
        an inner step always counts (its sync votes on its own)."""
        if self.sync_steps > 1:
            self.committed = True
            self.consumed[self.replica_id] += 1
            self._batch = None
            return True
        self.committed = bool(self.manager.should_commit())
        if self.committed:
            for i in self._live or ():
                self.consumed[i] += 1
            self._batch = None
            if self._check_next:
                self._check_step, self._check_next = self.state.step + 1, False
        else:
            self.discarded += 1
            cause = _first_line(self.manager.errored() or "too few live replica groups")
            self._say(f"step {self.state.step + 1} discarded ({cause}); it runs again")
        return self.committed

    def metrics(self) -> dict[str, float]:
        """Per logged step: live groups, quorum id, heals and cross-group syncs so far."""
        live = len(self._live) if self._live is not None else 1
        return {
            "live_replicas": live,
            "quorum_id": self._quorum_id,
            "heals": self.heals,
            "replica_syncs": self.syncs,
        }

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.__exit__(None, None, None)
        if self.manager is not None:
            with contextlib.suppress(Exception):  # a server that may be gone already
                self.manager.shutdown(wait=True)
        self.manager = None
        if self._log_handler is not None:
            logging.getLogger("torchft").removeHandler(self._log_handler)
            self._log_handler.close()

    # --- torchft --------------------------------------------------------------------------

    def _start(self) -> None:
        ft = self.cfg.fault_tolerance
        self._log_to_file()
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
        from torchft.checkpointing.http_transport import HTTPTransport

        timeout = timedelta(seconds=ft.timeout_s)
        world = self.pm.dims.world_size
        if world > 1:  # torchrun's store of this group
            host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:
            host = socket.gethostname()
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            port = self._store.port
        self._lighthouse = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
        if not self._lighthouse:
            raise FaultToleranceError(
                f"replica {self.replica_id}: no lighthouse: pass --fault-tolerance.lighthouse "
                "ADDRESS (see titan-train lighthouse), set TORCHFT_LIGHTHOUSE, or run "
                "--fault-tolerance.local-replicas N"
            )
        pg_cls = ProcessGroupGloo if ft.process_group == "gloo" else ProcessGroupNCCL
        transport = HTTPTransport(timeout=timeout, num_chunks=0)
        handler: Any = transport._server.RequestHandlerClass  # torchft's HTTP server
        handler.log_message = lambda *a, **k: None  # no request line per heal
        try:
            self.manager = Manager(
                pg=pg_cls(timeout=timeout),
                load_state_dict=None,
                state_dict=None,
                min_replica_size=ft.min_replicas,
                use_async_quorum=False,
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout,
                rank=self.rank,
                world_size=world,
                store_addr=host,
                store_port=port,
                lighthouse_addr=self._lighthouse,
                replica_id=f"replica_{self.replica_id}",
                checkpoint_transport=transport,
                init_sync=False,
            )
        except Exception as e:  # torchft: a RuntimeError naming the cause
            transport.shutdown(wait=False)
            raise FaultToleranceError(
                f"replica {self.replica_id}: cannot reach the torchft lighthouse at "
                f"{self._lighthouse} within --fault-tolerance.timeout-s {ft.timeout_s:g} "
                f"({_first_line(e)})"
            ) from None
        manager: Any = self.manager  # torchft keeps the quorum's replica ids in its client
        manager._client = _QuorumRecorder(manager._client, self._on_quorum)
        self.manager.register_state_dict_fn("titan", self._load_heal_state, self._heal_state)
        step = self._manager_step if self.sync_steps > 1 else self.state.step
        self.manager.load_state_dict({"step": step, "batches_committed": 0})
        if self.sync_steps > 1:
            self._start_diloco()

    def _start_diloco(self) -> None:
        from torchft.local_sgd import DiLoCo

        model = self.pm.parts[0]
        if self.outer is None:
            raise FaultToleranceError(
                "DiLoCo needs the outer optimizer (fault_tolerance.sync_steps > 1)"
            )
        nbytes = sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())
        self.diloco = DiLoCo(
            self.manager,
            [model],
            self.optimizer,
            self.outer,
            sync_every=self.sync_steps,
            use_bucketization=True,  # one all-reduce per sync
            bucket_cap_mb=nbytes // 2**20 + 1,
        )
        (fragment,) = self.diloco._fragments
        if self._resumed:  # the last synced weights, from the checkpoint
            for name, t in fragment.original_parameters.items():
                t.copy_(self._backup[name])
        self.diloco._local_step = self._local_step
        self.diloco.__enter__()

    def _quorum(self) -> None:
        try:
            self.manager.start_quorum()
        except NoPeerToRejoin:
            raise
        except Exception as e:  # no lighthouse, or no quorum formed
            raise FaultToleranceError(
                f"replica {self.replica_id}: no quorum from the torchft lighthouse at "
                f"{self._lighthouse} within --fault-tolerance.timeout-s "
                f"{self.cfg.fault_tolerance.timeout_s:g} ({_first_line(e)})"
            ) from None

    def _on_quorum(self, result: Any) -> None:
        """Each quorum (torchft's quorum thread): one line when the live groups change."""
        live = sorted({_replica_index(r) for r in result.replica_ids})
        first = self._live is None
        if first and self._rejoin and live == [self.replica_id]:
            raise NoPeerToRejoin(
                f"replica {self.replica_id}: restarted, but no live replica group is left to "
                "heal from (the others have finished)"
            )
        if self.sync_steps > 1:
            self.syncs += 1
        if first:
            self._say(f"joins quorum {result.quorum_id}: live replica groups {live}")
        elif live != self._live:
            self._say(
                f"step {self.state.step + 1}: live replica groups {self._live} -> {live} "
                f"(quorum {result.quorum_id})"
            )
        self._live, self._quorum_id = live, result.quorum_id
        if os.environ.get(HEAL_CHECK_ENV) == "1":
            self._check_next = bool(result.heal or result.recover_dst_replica_ranks)
        src = result.recover_src_replica_rank
        if result.heal and src is not None and src < len(result.replica_ids):
            self._heal_src = _replica_index(result.replica_ids[src])

    def _heal_state(self) -> dict[str, Any]:
        from titan_train.checkpointing import ModelState

        return {
            "model": ModelState(self.pm, per_rank=True).state_dict(),
            "optim": self.optimizer.state_dict(),
            "lr": self.scheduler.state_dict(),
            "step": self.state.step,
            "consumed": self.consumed.clone(),
        }

    def _load_heal_state(self, sd: dict[str, Any]) -> None:
        from titan_train.checkpointing import ModelState

        live = ModelState(self.pm, per_rank=True).state_dict()
        if set(live) != set(sd["model"]):
            raise RuntimeError("healing: the peer's weights do not match this group's layout")
        with torch.no_grad():
            for k, v in sd["model"].items():
                live[k].copy_(v)
        self.optimizer.load_state_dict(sd["optim"])
        self.scheduler.load_state_dict(sd["lr"])
        self.state.step = int(sd["step"])
        if self.sync_steps == 1:  # DiLoCo: each group keeps its own data position
            self._seek(sd["consumed"])
        self.heals += 1
        src = getattr(self, "_heal_src", "?")
        self._say(
            f"healed from replica {src} at step {self.state.step}: weights, optimizer state, "
            f"schedule; data position {int(self.consumed[self.replica_id])} batches"
        )

    def _seek(self, table: torch.Tensor) -> None:
        """Move this group's loader to ``table``'s position for it (what it trained)."""
        target = int(table[self.replica_id])
        pos = int(self.consumed[self.replica_id]) + (self._batch is not None)
        if target >= pos:
            self._batch = None
            for _ in range(target - pos):
                next(self.loader)
        self.consumed.copy_(table)

    def _save_heal_check(self) -> None:
        from titan_train.checkpointing import ModelState

        state = {
            "model": ModelState(self.pm, per_rank=True).state_dict(),
            "optim": self.optimizer.state_dict(),
        }
        torch.save(state, self.run_dir / f"heal-check-step-{self._check_step}-rank-{self.rank}.pt")
        self._check_step = None

    def _fault_point(self) -> None:
        spec = os.environ.get(FAULT_ENV)
        if not spec or os.environ.get(RESTART_ENV, "0") != "0":
            return
        replica, step = (int(x) for x in spec.split(":"))
        if replica == self.replica_id and self.state.step + 1 == step:
            os.kill(os.getpid(), signal.SIGKILL)

    def _say(self, text: str) -> None:
        if self.rank == 0:
            print(f"titan-train: replica {self.replica_id}: {text}", flush=True)

    def _log_to_file(self) -> None:
        """torchft's Python warnings and errors go to ``logs/torchft-rank-<r>.log`` (each
        failure and discard is one line of ours on the console)."""
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        logger = logging.getLogger("torchft")
        logger.propagate = False
        handler = logging.FileHandler(logs / f"torchft-rank-{self.rank}.log")
        handler.setLevel(logging.WARNING)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        logger.addHandler(handler)
        self._log_handler = handler
        warnings.filterwarnings("ignore", message="The given buffer is not writable")


class _State:
    """The checkpoint item of ``FaultTolerance``."""

    def __init__(self, ft: FaultTolerance) -> None:
        self.ft = ft

    def state_dict(self) -> dict[str, Any]:
        ft = self.ft
        out: dict[str, Any] = {"consumed": ft.consumed}
        out["manager_step"] = ft.manager.current_step() if ft.manager else ft._manager_step
        if ft.outer is not None:
            if ft.diloco is not None:
                (fragment,) = ft.diloco._fragments
                for name, t in fragment.original_parameters.items():
                    ft._backup[name].copy_(t)
                out["local_step"] = ft.diloco._local_step
            else:
                out["local_step"] = ft._local_step
            out["backup"] = ft._backup
        return out

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        ft = self.ft
        ft.consumed.copy_(sd["consumed"])
        ft._manager_step = int(sd["manager_step"])
        if ft.outer is not None:
            ft._local_step = int(sd["local_step"])
            for name, t in sd["backup"].items():
                ft._backup[name].copy_(t)
        ft._resumed = True


class _QuorumRecorder:
    """torchft's manager client, seen through: each quorum result is passed to ``on_quorum``
    (torchft keeps the live replica ids to itself)."""

    def __init__(self, client: Any, on_quorum: Any) -> None:
        self._client, self._on_quorum = client, on_quorum

    def _quorum(self, **kwargs: Any) -> Any:
        result = self._client._quorum(**kwargs)
        self._on_quorum(result)
        return result

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def _replica_index(replica_id: str) -> int:
    """``replica_<i>:<uuid>`` (torchft appends a uuid per incarnation) -> ``i``."""
    return int(replica_id.split(":")[0].rsplit("_", 1)[-1])


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _first_line(e: object) -> str:
    """The gist of an error: its first line, without gloo's source location, cut short."""
    text = str(getattr(e, "original_exception", e)).strip()
    line = (text.splitlines() or [type(e).__name__])[0]
    line = re.sub(r"^\[[^\]]*\.(cc|cpp|h|hpp):\d+\] ", "", line)
    return line if len(line) <= 160 else line[:157] + "..."
