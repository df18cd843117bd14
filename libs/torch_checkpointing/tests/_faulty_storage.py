"""A fault-injecting ``Storage`` for the tests (torch-free: the writer process unpickles it)."""

from __future__ import annotations

import errno
import json
import os
import time

from torch_checkpointing.storage import FileSystemStorage


class FaultyStorage:
    """A ``Storage`` over a local folder that injects the faults named in a JSON file.

    The file (read on every call, so a writer process sees changes too) holds
    ``{"fault": "enospc" | "erofs" | None, "match": substring of the paths it hits,
    "budget": bytes a matching write may still write before ENOSPC}``. ``"erofs"`` fails every
    mutation (write, rename, delete) of a matching path, like a folder turned read-only.
    """

    process_safe = True

    def __init__(self, root, fault_file):
        self.inner = FileSystemStorage(root, fsync=False)
        self.fault_file = str(fault_file)

    def __repr__(self):
        return f"FaultyStorage({self.inner.root!r})"

    def set_fault(self, fault=None, match="", budget=0):
        with open(self.fault_file, "w") as f:
            json.dump({"fault": fault, "match": match, "budget": budget}, f)

    def _fault(self, path):
        try:
            with open(self.fault_file) as f:
                spec = json.load(f)
        except FileNotFoundError:
            return None, 0
        if spec["fault"] is None or spec["match"] not in path:
            return None, 0
        return spec["fault"], spec["budget"]

    def write(self, path, chunks):
        fault, budget = self._fault(path)
        if fault == "erofs":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        if fault == "enospc":

            def limited():
                left = budget
                for chunk in chunks:
                    mv = memoryview(chunk).cast("B")
                    if mv.nbytes > left:
                        yield mv[:left]
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
                    left -= mv.nbytes
                    yield mv

            return self.inner.write(path, limited())
        return self.inner.write(path, chunks)

    def rename(self, src, dst):
        if self._fault(dst)[0] == "erofs":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), dst)
        self.inner.rename(src, dst)

    def delete(self, path):
        if self._fault(path)[0] == "erofs":
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        self.inner.delete(path)

    def read(self, path, offset=0, length=None):
        return self.inner.read(path, offset, length)

    def read_into(self, path, offset, buffer):
        self.inner.read_into(path, offset, buffer)

    def size(self, path):
        return self.inner.size(path)

    def list(self, path):
        return self.inner.list(path)

    def exists(self, path):
        return self.inner.exists(path)


class StallUntilOrphanedStorage(FileSystemStorage):
    """A local folder whose writes of paths containing ``match`` wait, in the writer process,
    until the trainer that made the storage (``owner_pid``) is gone, then go on.

    The first such write records the writer's pid in ``started``: the moment to kill the
    trainer with a save in the middle of being written.
    """

    def __init__(self, root, *, match, started, owner_pid):
        super().__init__(root, fsync=False)
        self.match = match
        self.started = str(started)
        self.owner_pid = owner_pid

    def write(self, path, chunks):
        if self.match in path:
            with open(self.started + ".tmp", "w") as f:
                f.write(str(os.getpid()))
            os.replace(self.started + ".tmp", self.started)
            deadline = time.monotonic() + 120
            while os.getppid() == self.owner_pid and time.monotonic() < deadline:
                time.sleep(0.005)
        return super().write(path, chunks)
