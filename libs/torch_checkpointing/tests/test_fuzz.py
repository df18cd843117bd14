"""Property-based fuzzing of every metadata reader and of ``load(fallback=True)``: on any
input (random bytes, random JSON, forged fields under a valid checksum) the outcome is the
checkpoint loaded bitwise or the library's damaged-checkpoint error; each case within 1 s and
no read outside the root. A fast deterministic slice (the longer run: tests/chaos)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _fuzz_cases as fc


def fast(n: int):
    return settings(
        max_examples=n,
        derandomize=True,
        deadline=1000,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


@pytest.fixture(scope="module")
def fx(tmp_path_factory) -> fc.Fixture:
    return fc.Fixture(tmp_path_factory.mktemp("fuzz"))


# -------------------------------------------------------------- load_checked: raw bytes


@fast(1200)
@given(data=fc.hostile_bytes)
def test_checked_json_reader_on_hostile_bytes(data):
    fc.check_bytes_reader(data)


@fast(800)
@given(forgery=fc.forgeries, which=fc.st.sampled_from(["manifest", "marker"]))
def test_checked_json_reader_on_forgeries(fx, forgery, which):
    fc.check_bytes_reader(fc.sealed(fc.forge(getattr(fx, which), *forgery)))


# ------------------------------------------------------------------------- manifest


@fast(1000)
@given(data=fc.hostile_bytes)
def test_manifest_reader_on_hostile_bytes(fx, data):
    fc.check_manifest_reader(fx, data)


@fast(1000)
@given(forgery=fc.forgeries)
def test_manifest_reader_on_forgeries(fx, forgery):
    fc.check_manifest_reader(fx, fc.sealed(fc.forge(fx.manifest, *forgery)))


# ------------------------------------------------------------------------ done-marker


@fast(700)
@given(data=fc.hostile_bytes)
def test_marker_reader_on_hostile_bytes(fx, data):
    fc.check_marker_reader(fx, data)


@fast(1300)
@given(forgery=fc.forgeries)
def test_marker_reader_on_forgeries(fx, forgery):
    fc.check_marker_reader(fx, fc.sealed(fc.forge(fx.marker, *forgery)))


# ------------------------------------------------------------------- load(fallback=True)


@fast(300)
@given(data=fc.hostile_bytes, which=fc.st.sampled_from(["manifest", "marker"]))
def test_load_with_fallback_on_hostile_bytes(fx, data, which):
    fc.check_load_fallback(fx, which, data)


@fast(1700)
@given(forgery=fc.forgeries, which=fc.st.sampled_from(["manifest", "marker"]))
def test_load_with_fallback_on_forgeries(fx, forgery, which):
    fc.check_load_fallback(fx, which, fc.sealed(fc.forge(getattr(fx, which), *forgery)))
