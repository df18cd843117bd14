"""Where checkpoint bytes live: the ``Storage`` protocol and two backends.

Paths are relative, ``/``-separated names under the storage's root (``"step-.../model-00000
.safetensors"``). A backend must support:

=========================================  ====================================================
``write(path, chunks)``                    create or replace ``path`` with the concatenation of
                                           ``chunks`` (bytes-like objects), creating parent
                                           folders; durable when it returns if the backend
                                           offers durability
``read(path, offset=0, length=None)``      bytes ``[offset, offset + length)`` of ``path``
``read_into(path, offset, buffer)``        fill the writable ``buffer`` from ``offset``
``size(path)``                             size in bytes; ``FileNotFoundError`` when missing
``list(path)``                             names directly inside the folder ``path`` (``""`` is
                                           the root); ``[]`` when it does not exist
``exists(path)``                           whether a file or folder ``path`` exists
``delete(path)``                           remove a file or a whole folder; missing is fine
``rename(src, dst)``                       move ``src`` to ``dst``, replacing ``dst`` (atomic
                                           where the backend allows it)
``write_at(path, writes)`` (optional)      write each ``(offset, bytes-like)`` into the
                                           existing file ``path``, growing it as needed; what
                                           lets several ranks fill one file (``save_hf``)
=========================================  ====================================================

``process_safe`` tells whether a pickled copy used in another process sees the same files
(false for in-memory filesystems); ``async_mode="process"`` needs it. Nothing here imports
torch, so the background writer process stays light.
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import fcntl
import os
import posixpath
import shutil
import stat
from collections.abc import Iterable
from typing import Any, Protocol, cast, runtime_checkable

from ._errors import CheckpointError, CorruptCheckpointError

__all__ = ["FileSystemStorage", "FsspecStorage", "PrefixedStorage", "Storage", "open_reader"]


class _WritesAt(Protocol):
    """A storage with the optional ``write_at``."""

    def write_at(self, path: str, writes: Iterable[tuple[int, Any]]) -> None: ...


@runtime_checkable
class Storage(Protocol):
    """The operations a checkpoint backend provides (see the module docstring)."""

    process_safe: bool

    def write(self, path: str, chunks: Iterable[Any]) -> None: ...

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes: ...

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None: ...

    def size(self, path: str) -> int: ...

    def list(self, path: str) -> builtins.list[str]: ...  # `list` here is this method

    def exists(self, path: str) -> bool: ...

    def delete(self, path: str) -> None: ...

    def rename(self, src: str, dst: str) -> None: ...


class _ReadIntoReader:
    """Sequential scatter reads of one file through any storage's ``read_into``."""

    def __init__(self, storage: Any, path: str) -> None:
        self.storage, self.path = storage, path

    def readv(self, offset: int, buffers: list[memoryview]) -> None:
        for b in buffers:
            self.storage.read_into(self.path, offset, b)
            offset += b.nbytes

    def close(self) -> None:
        pass


class _FileReader:
    """One open file: each ``readv`` one ``preadv`` (looped on short reads) scattering the
    bytes from ``offset`` into ``buffers``."""

    def __init__(self, full: str) -> None:
        self.full = full
        self.fd = os.open(full, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        with contextlib.suppress(OSError, AttributeError):  # a hint for this open file only
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)

    def readv(self, offset: int, buffers: list[memoryview]) -> None:
        bufs = [memoryview(b).cast("B") for b in buffers]
        bufs = [b for b in bufs if b.nbytes]
        while bufs:
            n = os.preadv(self.fd, bufs, offset)
            if n == 0:
                raise EOFError(
                    f"{self.full}: wanted {sum(b.nbytes for b in bufs)} more bytes at offset "
                    f"{offset}, the file ends there"
                )
            offset += n
            while bufs and n >= bufs[0].nbytes:
                n -= bufs[0].nbytes
                bufs.pop(0)
            if n:
                bufs[0] = bufs[0][n:]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def open_reader(storage: Any, path: str) -> Any:
    """A reader of ``path`` with ``readv(offset, buffers)`` and ``close()``: one open file and
    one ``preadv`` per call on a ``FileSystemStorage`` whose ``read_into`` is its own (a
    subclass overriding ``read_into`` keeps seeing every read); ``read_into`` per buffer on
    any other storage."""
    opener = getattr(storage, "open_reader", None)
    if callable(opener):
        return opener(path)
    return _ReadIntoReader(storage, path)


def _check_relative(path: str) -> str:
    if not isinstance(path, str):
        raise TypeError(f"storage path must be a str, got {type(path).__name__}")
    norm = posixpath.normpath(path) if path else ""
    if norm in (".", ""):
        return ""
    if norm.startswith("/") or norm == ".." or norm.startswith("../"):
        raise ValueError(f"storage path {path!r} must stay inside the storage root")
    return norm


class FileSystemStorage:
    """Files under a local (or mounted) folder.

    ``create=True`` makes the folder when missing. ``fsync=True`` (default) flushes each
    written file and the folder entries of renames to disk, so a completed checkpoint survives
    a power loss, not just a process crash. ``direct_io=True`` (default) writes the
    page-aligned parts of large buffers with ``O_DIRECT`` where the filesystem supports it:
    checkpoint data bypasses the page cache (it is written once and read rarely), which is
    both faster and kinder to the training job's memory. Everything else is ordinary I/O.
    """

    process_safe = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fsync: bool = True,
        create: bool = True,
        direct_io: bool = True,
    ) -> None:
        if not isinstance(root, str | os.PathLike):
            raise TypeError(
                f"FileSystemStorage: root must be a str or os.PathLike, got {type(root).__name__}"
            )
        self.root = os.path.abspath(os.fspath(root))
        self.fsync = bool(fsync)
        self.direct_io = bool(direct_io) and _O_DIRECT != 0
        if not create and not os.path.isdir(self.root):
            raise FileNotFoundError(f"checkpoint folder {self.root!r} does not exist")
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:
            raise CheckpointError(
                f"checkpoint root {self.root!r} does not exist and cannot be created: {e}"
            ) from e
        if not os.path.isdir(self.root):
            raise CheckpointError(f"checkpoint root {self.root!r} is not a folder")

    def __repr__(self) -> str:
        return f"FileSystemStorage({self.root!r}, fsync={self.fsync})"

    def full_path(self, path: str) -> str:
        rel = _check_relative(path)
        return os.path.join(self.root, rel) if rel else self.root

    def write(self, path: str, chunks: Iterable[Any]) -> None:
        full = self.full_path(path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        direct = False
        pos = 0
        try:
            for chunk in chunks:
                mv = memoryview(chunk).cast("B")
                if (
                    self.direct_io
                    and pos % _ALIGN == 0
                    and mv.nbytes >= _ALIGN
                    and _address(mv) % _ALIGN == 0
                ):
                    if not direct:
                        direct = self._set_direct(fd, True)
                    if direct:
                        n = mv.nbytes - mv.nbytes % _ALIGN
                        try:
                            _write_all(fd, mv[:n])
                            pos += n
                            mv = mv[n:]
                        except OSError as e:
                            if e.errno != errno.EINVAL:
                                raise
                            # Accepted O_DIRECT but cannot do it: plain writes from here on.
                            # A failed O_DIRECT write writes nothing, so pos is still right.
                            self.direct_io = False
                            direct = not self._set_direct(fd, False)
                            os.lseek(fd, pos, os.SEEK_SET)
                if mv.nbytes:
                    if direct:
                        direct = not self._set_direct(fd, False)
                    _write_all(fd, mv)
                    pos += mv.nbytes
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def write_at(self, path: str, writes: Iterable[tuple[int, Any]]) -> None:
        """Write each ``(offset, bytes-like)`` into the existing file ``path`` (several
        processes may fill disjoint ranges of one file); durable on return with ``fsync``."""
        fd = os.open(self.full_path(path), os.O_WRONLY)
        try:
            for offset, chunk in writes:
                mv = memoryview(chunk).cast("B")
                done = 0
                while done < mv.nbytes:
                    done += os.pwrite(fd, mv[done:], offset + done)
            if self.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def _set_direct(self, fd: int, on: bool) -> bool:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, (flags | _O_DIRECT) if on else (flags & ~_O_DIRECT))
        except OSError:
            if on:
                self.direct_io = False  # this filesystem (tmpfs, ...) has no O_DIRECT
                return False
            raise
        return True

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        full = self.full_path(path)
        with open(full, "rb") as f:
            f.seek(offset)
            data = f.read() if length is None else f.read(length)
        if length is not None and len(data) != length:
            raise EOFError(
                f"{full}: wanted {length} bytes at offset {offset}, the file ends after {len(data)}"
            )
        return data

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        full = self.full_path(path)
        mv = memoryview(buffer).cast("B")
        want = mv.nbytes
        fd = os.open(full, os.O_RDONLY)
        try:
            done = 0
            while done < want:
                n = os.preadv(fd, [mv[done:]], offset + done)
                if n == 0:
                    raise EOFError(
                        f"{full}: wanted {want} bytes at offset {offset}, the file ends after "
                        f"{done}"
                    )
                done += n
        finally:
            os.close(fd)

    def read_small(self, path: str, limit: int, *, trusted: str = "") -> bytes:
        """All of the small file ``path`` when it is a regular file of at most ``limit`` bytes
        reached without following a symlink below the root (or below the folder ``trusted``
        inside it, a user's choice); else a ``CorruptCheckpointError`` (a FIFO is never waited
        on, a device or an oversized file never read)."""
        rel = _check_relative(path)
        base = _check_relative(trusted)
        if base and (rel + "/").startswith(base + "/"):
            rel = rel[len(base) + 1 :]
        else:
            base = ""
        parts = rel.split("/")
        flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(self.full_path(base), os.O_RDONLY | os.O_DIRECTORY)
        try:
            for part in parts[:-1]:
                nxt = os.open(part, flags | os.O_DIRECTORY, dir_fd=fd)
                os.close(fd)
                fd = nxt
            nxt = os.open(parts[-1], flags | os.O_NONBLOCK, dir_fd=fd)
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{path}: not a regular file", path)
            if st.st_size > limit:
                raise CorruptCheckpointError(
                    f"{path}: {st.st_size} bytes, more than any real metadata file ({limit})", path
                )
            chunks = []
            left = st.st_size
            while left > 0:
                b = os.read(fd, left)
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def open_reader(self, path: str) -> Any:
        """A reader of ``path`` for many large scatter reads (see ``open_reader``)."""
        if type(self).read_into is not FileSystemStorage.read_into:
            return _ReadIntoReader(self, path)
        return _FileReader(self.full_path(path))

    def size(self, path: str) -> int:
        return os.stat(self.full_path(path)).st_size

    def list(self, path: str) -> builtins.list[str]:  # `list` is the method here
        try:
            return sorted(os.listdir(self.full_path(path)))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, path: str) -> bool:
        return os.path.exists(self.full_path(path))

    def delete(self, path: str) -> None:
        full = self.full_path(path)
        if full == self.root:
            raise ValueError("FileSystemStorage.delete: refusing to delete the storage root")
        if os.path.isdir(full) and not os.path.islink(full):
            with contextlib.suppress(FileNotFoundError):
                shutil.rmtree(full)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(full)

    def rename(self, src: str, dst: str) -> None:
        full_dst = self.full_path(dst)
        os.replace(self.full_path(src), full_dst)
        if self.fsync:
            _fsync_dir(os.path.dirname(full_dst))


_ALIGN = 4096
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _address(mv: memoryview) -> int:
    """Address of a buffer's first byte (1, i.e. unaligned, when it is read-only)."""
    if mv.readonly or mv.nbytes == 0:
        return 1
    ref = ctypes.c_char.from_buffer(mv)
    try:
        return ctypes.addressof(ref)
    finally:
        del ref


def _write_all(fd: int, mv: memoryview) -> None:
    while mv.nbytes:
        n = os.write(fd, mv)
        mv = mv[n:]


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems cannot fsync a folder; the data files are synced
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


class FsspecStorage:
    """Any fsspec filesystem (``pip install titan-checkpointing[fsspec]``).

    ``FsspecStorage("memory://ckpt")``, ``FsspecStorage("file:///data/ckpt")``, or
    ``FsspecStorage(fs=my_fs, root="bucket/ckpt")``. Renames use the filesystem's ``mv``
    (a copy and a delete on object stores, where the manifest and done-markers, written last,
    still make a checkpoint complete only once everything is in place).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        fs: Any = None,
        root: str | None = None,
        **storage_options: Any,
    ) -> None:
        try:
            import fsspec
        except ImportError as e:  # pragma: no cover - fsspec is installed in dev
            raise ImportError(
                "FsspecStorage needs fsspec: pip install 'titan-checkpointing[fsspec]'"
            ) from e
        if (url is None) == (fs is None):
            raise ValueError("FsspecStorage: pass exactly one of url=... or fs=... (with root=)")
        if fs is None:
            if not isinstance(url, str):
                raise TypeError(f"FsspecStorage: url must be a str, got {type(url).__name__}")
            fs, root = fsspec.core.url_to_fs(url, **storage_options)
        elif root is None:
            raise ValueError("FsspecStorage: fs=... needs root=... (a folder on that filesystem)")
        self.fs = fs
        self.root = str(root).rstrip("/") or "/"
        protocols = fs.protocol if isinstance(fs.protocol, tuple | list) else (fs.protocol,)
        self.process_safe = "memory" not in protocols
        self.fs.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"FsspecStorage(fs={type(self.fs).__name__}, root={self.root!r})"

    def _full(self, path: str) -> str:
        rel = _check_relative(path)
        return f"{self.root}/{rel}" if rel else self.root

    def write(self, path: str, chunks: Iterable[Any]) -> None:
        full = self._full(path)
        self.fs.makedirs(posixpath.dirname(full), exist_ok=True)
        with self.fs.open(full, "wb") as f:
            for chunk in chunks:
                f.write(memoryview(chunk).cast("B"))

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        full = self._full(path)
        end = None if length is None else offset + length
        data = self.fs.cat_file(full, start=offset, end=end)
        if length is not None and len(data) != length:
            raise EOFError(
                f"{full}: wanted {length} bytes at offset {offset}, the file ends after {len(data)}"
            )
        return bytes(data)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        mv = memoryview(buffer).cast("B")
        mv[:] = self.read(path, offset, mv.nbytes)

    def size(self, path: str) -> int:
        full = self._full(path)
        if not self.fs.isfile(full):
            raise FileNotFoundError(full)
        return int(self.fs.size(full))

    def list(self, path: str) -> builtins.list[str]:  # `list` is the method here
        full = self._full(path)
        try:
            if not self.fs.isdir(full):
                return []
            names = self.fs.ls(full, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(str(n).rstrip("/")) for n in names)

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(self._full(path)))

    def delete(self, path: str) -> None:
        full = self._full(path)
        if _check_relative(path) == "":
            raise ValueError("FsspecStorage.delete: refusing to delete the storage root")
        with contextlib.suppress(FileNotFoundError):
            if self.fs.exists(full):
                self.fs.rm(full, recursive=True)

    def rename(self, src: str, dst: str) -> None:
        full_dst = self._full(dst)
        if self.fs.exists(full_dst):
            self.fs.rm(full_dst)
        self.fs.mv(self._full(src), full_dst)


class PrefixedStorage:
    """A folder inside another storage (``CheckpointManager(root, storage=s)``)."""

    def __init__(self, inner: Storage, prefix: str) -> None:
        self.inner = inner
        self.prefix = _check_relative(str(prefix).replace(os.sep, "/"))
        self.process_safe = getattr(inner, "process_safe", True)
        if callable(getattr(inner, "write_at", None)):  # only where the inner storage can
            self.write_at = self._write_at

    def _write_at(self, path: str, writes: Iterable[tuple[int, Any]]) -> None:
        cast(_WritesAt, self.inner).write_at(self._p(path), writes)  # checked in __init__

    def __repr__(self) -> str:
        return f"{self.inner!r}/{self.prefix}"

    def _p(self, path: str) -> str:
        rel = _check_relative(path)
        return f"{self.prefix}/{rel}" if rel and self.prefix else rel or self.prefix

    def write(self, path: str, chunks: Iterable[Any]) -> None:
        self.inner.write(self._p(path), chunks)

    def read(self, path: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.read(self._p(path), offset, length)

    def read_into(self, path: str, offset: int, buffer: memoryview) -> None:
        self.inner.read_into(self._p(path), offset, buffer)

    def open_reader(self, path: str) -> Any:
        return open_reader(self.inner, self._p(path))

    def read_small(self, path: str, limit: int, *, trusted: str = "") -> bytes:
        """``_format.read_small`` through the inner storage; the prefix is the user's choice
        and may hold symlinks."""
        inner = getattr(self.inner, "read_small", None)
        if not callable(inner):
            from ._format import read_small

            return read_small(self.inner, self._p(path), limit)
        return inner(self._p(path), limit, trusted=self._p(trusted))

    def size(self, path: str) -> int:
        return self.inner.size(self._p(path))

    def list(self, path: str) -> builtins.list[str]:  # `list` is the method here
        return self.inner.list(self._p(path))

    def exists(self, path: str) -> bool:
        return self.inner.exists(self._p(path))

    def delete(self, path: str) -> None:
        if _check_relative(path) == "":
            raise ValueError("PrefixedStorage.delete: refusing to delete the root")
        self.inner.delete(self._p(path))

    def rename(self, src: str, dst: str) -> None:
        self.inner.rename(self._p(src), self._p(dst))
