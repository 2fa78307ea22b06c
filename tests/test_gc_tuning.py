"""The workers' garbage-collector settings (workers/gc_tuning.py): applied once a worker
is up, and `GENPIPE_GC_TUNING=0` keeps Python's defaults."""

from __future__ import annotations

import gc

import pytest

from workers.gc_tuning import tune_after_startup


@pytest.fixture
def restore_gc():
    yield
    gc.unfreeze()


def test_start_up_objects_leave_the_collectors_sight(restore_gc, monkeypatch):
    monkeypatch.delenv("GENPIPE_GC_TUNING", raising=False)
    built_at_start = [object() for _ in range(10)]  # noqa: F841 (alive through the freeze)
    assert tune_after_startup()
    assert gc.get_freeze_count() > 0


def test_turned_off_keeps_pythons_defaults(restore_gc, monkeypatch):
    monkeypatch.setenv("GENPIPE_GC_TUNING", "0")
    assert not tune_after_startup()
    assert gc.get_freeze_count() == 0
