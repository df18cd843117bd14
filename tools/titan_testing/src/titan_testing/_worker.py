"""Entry point of one rank started by ``titan_testing.run_distributed`` (not a public API)."""

from __future__ import annotations

import faulthandler
import importlib
import importlib.util
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from types import ModuleType
from typing import Any


def _load_module(name: str, file: str) -> ModuleType:
    mod = sys.modules.get(name)
    if (
        mod is not None
        and getattr(mod, "__file__", None)
        and Path(mod.__file__).resolve() == Path(file)
    ):
        return mod
    try:
        mod = importlib.import_module(name)
        if getattr(mod, "__file__", None) and Path(mod.__file__).resolve() == Path(file):
            return mod
    except ImportError:
        pass
    # Test modules imported by pytest's importlib mode are not importable by name: load the
    # file itself under the same module name so pickled objects from it resolve. A script's
    # __main__ is loaded as __mp_main__ (as multiprocessing does), so its
    # `if __name__ == "__main__":` block does not run again in every rank and spawn ranks of
    # its own; the alias keeps pickled references to __main__ working.
    load_as = "__mp_main__" if name == "__main__" else name
    spec = importlib.util.spec_from_file_location(load_as, file)
    assert spec is not None and spec.loader is not None, file
    mod = importlib.util.module_from_spec(spec)
    sys.modules[load_as] = mod
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _resolve(mod: ModuleType, qualname: str) -> Any:
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _exit_with_parent(parent: int) -> None:
    """Exit when the process that started this rank is gone: a rank lives in its own session
    (so the harness can kill its group), and a harness killed without running its cleanup
    (``timeout``'s SIGTERM, SIGKILL) would otherwise leave it running, e.g. blocked in a
    collective, for ever."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="titan-testing-parent-watch", daemon=True).start()


def main() -> None:
    _exit_with_parent(os.getppid())
    payload_path, rank_s, result_path, error_path, stacks_path = sys.argv[1:6]
    rank = int(rank_s)
    stacks_file = open(stacks_path, "w")  # noqa: SIM115 - must outlive this frame
    faulthandler.register(signal.SIGUSR1, file=stacks_file, all_threads=True)
    try:
        payload = pickle.loads(Path(payload_path).read_bytes())
        sys.path[:] = payload["sys_path"]
        import torch

        torch.set_num_threads(payload["num_threads"])
        fn = _resolve(_load_module(payload["module"], payload["file"]), payload["qualname"])
        args, kwargs = pickle.loads(payload["args"])
        initialised = False
        if payload["init_process_group"]:
            import torch.distributed as dist

            backend = payload["backend"]
            if "nccl" in backend:
                torch.cuda.set_device(rank % max(1, torch.cuda.device_count()))
            store = dist.TCPStore("127.0.0.1", payload["port"], is_master=False)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=payload["world_size"]
            )
            initialised = True
        result = fn(*args, **kwargs)
        data = pickle.dumps(result)
        if initialised:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.barrier()
                dist.destroy_process_group()
        _write_atomic(Path(result_path), data)
    except BaseException:
        _write_atomic(Path(error_path), f"rank {rank}: {traceback.format_exc()}".encode())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: it can hang on background threads a test left behind.
    os._exit(0)


if __name__ == "__main__":
    main()
