"""The workers' garbage-collector settings (workers/gc_tuning.py): applied once a worker
is up, and `GENPIPE_GC_TUNING=0` keeps Python's defaults."""

from __future__ import annotations

import gc

import pytest

from workers.gc_tuning import YOUNG_THRESHOLD, check_setting, tune_after_startup
from workers.startup import UsageError


@pytest.fixture
def restore_gc():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_start_up_objects_leave_the_collectors_sight(restore_gc, monkeypatch):
    monkeypatch.delenv("GENPIPE_GC_TUNING", raising=False)
    built_at_start = [object() for _ in range(10)]  # noqa: F841 (alive through the freeze)
    assert tune_after_startup()
    assert gc.get_freeze_count() > 0


def test_a_loop_turns_objects_are_not_collected_while_alive(restore_gc, monkeypatch):
    """A worker's loop turn holds thousands of young objects alive (a poll's records and
    their results): the young generation is collected only past that, not every 700."""
    monkeypatch.delenv("GENPIPE_GC_TUNING", raising=False)
    gc.set_threshold(700, 10, 10)  # Python's defaults, whatever ran before
    assert tune_after_startup()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    collections = []
    gc.callbacks.append(on_collect := lambda phase, info: collections.append(info["generation"]))
    try:
        gc.collect()
        collections.clear()
        turn = [{"record": i, "headers": [("a", b"b")]} for i in range(3000)]  # ~6,000 alive at once
        del turn
    finally:
        gc.callbacks.remove(on_collect)
    assert collections == []


def test_turned_off_keeps_pythons_defaults(restore_gc, monkeypatch):
    monkeypatch.setenv("GENPIPE_GC_TUNING", "0")
    gc.set_threshold(700, 10, 10)
    assert not tune_after_startup()
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == (700, 10, 10)


def test_the_setting_is_0_or_1_and_nothing_else(monkeypatch):
    monkeypatch.delenv("GENPIPE_GC_TUNING", raising=False)
    assert check_setting() is True
    for value, on in (("1", True), (" 0 ", False)):
        monkeypatch.setenv("GENPIPE_GC_TUNING", value)
        assert check_setting() is on
    for typo in ("false", "off", "no", ""):
        monkeypatch.setenv("GENPIPE_GC_TUNING", typo)
        with pytest.raises(UsageError, match="expected 1 .* or 0"):
            check_setting()
