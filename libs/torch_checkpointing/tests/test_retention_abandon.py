"""A job ending on a dead peer must not wait out retention: the newest save's part from the
dead rank never arrives, so ``close(abandon_retention=True)`` (what the context manager does
on an exception) stops the wait and deletes nothing."""

from __future__ import annotations

import threading
import time
import warnings

import pytest

from torch_checkpointing import FileSystemStorage
from torch_checkpointing import _format as fmt
from torch_checkpointing._writer import BackgroundWriter


def _close_in_thread(writer: BackgroundWriter, **kwargs) -> threading.Thread:
    closer = threading.Thread(target=writer.close, kwargs=kwargs, daemon=True)
    closer.start()
    closer.join(timeout=60)  # a hang guard, far below the 3600 s wait: not a timing claim
    return closer


@pytest.mark.parametrize("mode", ["thread", "process"])
def test_abandoned_retention_stops_waiting_for_a_dead_peer_and_deletes_nothing(tmp_path, mode):
    storage = FileSystemStorage(tmp_path)
    old = fmt.step_dir(1, "a" * 12, 0)
    (tmp_path / old).mkdir()
    (tmp_path / old / "kept.bin").write_bytes(b"an older checkpoint's data")
    never = fmt.step_dir(2, "a" * 12, 1)  # the dead peer never completes it
    (tmp_path / never).mkdir()
    writer = BackgroundWriter(mode, storage, on_damaged=lambda damaged: None)
    if mode == "process":
        writer._ensure_proc()  # a save's job starts it before any retention
    spec = {"dir": never, "keep_last": 1, "lineage": "x", "own_nonces": ["a" * 12], "seq": 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer.submit(("retain", {**spec, "wait_s": 3600.0}))
        writer.submit(("retain", {**spec, "wait_s": 3600.0}))  # a queued one is dropped
        time.sleep(0.5)  # the first one is waiting now
        closer = _close_in_thread(writer, abandon_retention=True)
    assert not closer.is_alive(), "close(abandon_retention=True) waited for the dead peer"
    assert not caught, [str(w.message) for w in caught]  # stopping on purpose: not a failure
    assert (tmp_path / old / "kept.bin").read_bytes() == b"an older checkpoint's data"
    assert (tmp_path / never).is_dir()


def test_a_plain_close_still_waits_for_the_newest_save(tmp_path):
    storage = FileSystemStorage(tmp_path)
    never = fmt.step_dir(2, "a" * 12, 1)
    (tmp_path / never).mkdir()
    writer = BackgroundWriter("thread", storage, on_damaged=lambda damaged: None)
    spec = {"dir": never, "keep_last": 1, "lineage": "x", "own_nonces": [], "seq": 1}
    writer.submit(("retain", {**spec, "wait_s": 1.0}))
    closer = _close_in_thread(writer)
    assert not closer.is_alive()
    assert writer._abandon.is_set() is False  # it waited its bounded time, not abandoned
