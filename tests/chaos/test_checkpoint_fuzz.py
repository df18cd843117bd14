"""Chaos suite, checkpoint metadata: the long fuzz run of torch_checkpointing's metadata readers
and ``load(fallback=True)`` (the fast deterministic slice runs with the library's tests). Fresh
random cases every run, larger and deeper inputs; only "loaded bitwise" or the library's
damaged-checkpoint error may come out, each case within 1 s. About 2 minutes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "libs/torch_checkpointing/tests"))
import _fuzz_cases as fc

pytestmark = pytest.mark.slow


def long(n: int):
    return settings(
        max_examples=n,
        deadline=1000,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


big_bytes = st.one_of(
    fc.hostile_bytes,
    st.binary(min_size=1000, max_size=100_000),
    st.integers(10_000, 200_000).map(lambda n: b"[" * n),
    st.integers(10_000, 200_000).map(lambda n: fc.sealed_raw(fc.deep(n))),
)


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> fc.Fixture:
    return fc.Fixture(tmp_path_factory.mktemp("fuzz"))


@long(3000)
@given(data=big_bytes)
def test_checked_json_reader(data):
    fc.check_bytes_reader(data)


@long(3000)
@given(data=big_bytes | fc.forgeries, which=st.sampled_from(["manifest", "marker"]))
def test_manifest_and_marker_readers(fx, data, which):
    if isinstance(data, tuple):
        data = fc.sealed(fc.forge(getattr(fx, which), *data))
    if which == "manifest":
        fc.check_manifest_reader(fx, data)
    else:
        fc.check_marker_reader(fx, data)


@long(3000)
@given(
    data=big_bytes | fc.forgeries,
    forged_twice=fc.forgeries,
    which=st.sampled_from(["manifest", "marker"]),
)
def test_load_with_fallback(fx, data, forged_twice, which):
    if isinstance(data, tuple):  # two fields forged at once
        data = fc.sealed(fc.forge(fc.forge(getattr(fx, which), *data), *forged_twice))
    fc.check_load_fallback(fx, which, data)
