"""Requests whose chunks stop coming (workers/derender/stalls.py, `Derenderer.end_stalled`):
found by their partition's log time, not the clock; no broker."""

from __future__ import annotations

from schemas.headers import HEADER_ATTEMPT, HEADER_FINAL, HEADER_RESTART, HEADER_SEQ
from schemas.openai import ErrorResponse
from schemas.records import OutputOptions
from tests.derender_support import cancels, encode_ids, make_chunks, results, run_chunks
from workers.derender.stalls import StalledRequests
from workers.derender.state import Derenderer


def test_a_request_is_stalled_once_other_chunks_carry_its_partition_past_the_timeout():
    stalls = StalledRequests(timeout_s=2.0)  # (one gap between records counts at most 0.2 s)
    assert list(stalls.chunk(0, "a", 10_000, True)) == []
    for t in range(10_100, 12_001, 100):  # b's chunks every 0.1 s, to 2.0 s past a's
        assert list(stalls.chunk(0, "b", t, True)) == []
    assert list(stalls.chunk(0, "b", 12_001, True)) == ["a"]
    assert list(stalls.chunk(0, "b", 12_100, True)) == []  # said once; b's own chunks keep it going
    assert stalls.open_requests(0) == 1


def test_log_time_is_per_partition_and_a_request_s_own_late_chunk_keeps_it():
    stalls = StalledRequests(timeout_s=2.0)
    stalls.chunk(0, "a", 10_000, True)
    assert list(stalls.chunk(1, "x", 50_000, True)) == []  # another partition's time is not a's
    assert list(stalls.chunk(0, "a", 60_000, True)) == []  # nothing else came meanwhile: a goes on
    assert stalls.open_requests(0) == 1


def test_a_pause_of_the_whole_partition_counts_one_gap():
    # A broker away for an hour, or generate paused: the first chunk after it is an hour
    # newer, and the requests whose next chunks are right behind it must not end.
    stalls = StalledRequests(timeout_s=1800.0)  # a gap counts at most 60 s
    stalls.chunk(0, "a", 10_000, True)
    stalls.chunk(0, "b", 10_100, True)
    assert list(stalls.chunk(0, "b", 10_100 + 3_600_000, True)) == []
    assert list(stalls.chunk(0, "a", 10_200 + 3_600_000, True)) == []
    # and a first record without a timestamp does not make the first real one a jump
    stalls = StalledRequests(timeout_s=2.0)
    stalls.chunk(0, "a", -1, True)
    assert list(stalls.chunk(0, "b", 1_700_000_000_000, True)) == []
    assert list(stalls.chunk(0, "b", -1, True)) == []


def test_a_finished_request_is_forgotten_and_an_old_timestamp_does_not_turn_time_back():
    stalls = StalledRequests(timeout_s=2.0)
    stalls.chunk(0, "a", 10_000, True)
    stalls.chunk(0, "a", 10_100, False)  # its final chunk
    stalls.chunk(0, "b", 10_200, True)
    # A generate host whose clock runs behind: its chunk is marked with the partition's
    # time when read, not its own, so it is not aged by the other hosts' clocks.
    stalls.chunk(0, "c", 1_000, True)
    for t in range(10_300, 12_201, 100):
        assert list(stalls.chunk(0, "d", t, True)) == []
    assert list(stalls.chunk(0, "d", 12_201, True)) == ["b", "c"]
    assert list(stalls.chunk(0, "d", 12_202, True)) == []


def test_a_revoked_partition_starts_afresh():
    stalls = StalledRequests(timeout_s=0.5)
    stalls.chunk(0, "a", 10_000, True)
    stalls.forget(0)
    for t in range(10_000, 11_001, 50):
        assert list(stalls.chunk(0, "b", t, True)) == []  # a was the revoked partition's
    assert stalls.open_requests(0) == 1


def test_a_stalled_request_ends_with_an_error_result_and_a_cancel_and_its_late_chunks_are_dropped(tiny_model_dir):
    derenderer = Derenderer(str(tiny_model_dir))
    ids = encode_ids(derenderer.tables, "one two three four")
    chunks = make_chunks("r", ids, sizes=[1, 1, len(ids) - 2], output=OutputOptions(stream=True))
    out = run_chunks(derenderer, chunks[:2])
    assert len(results(out)) == 2 and derenderer.is_active("r")

    out = derenderer.end_stalled("r", 1800)
    [result], [cancel] = results(out), cancels(out)
    assert isinstance(result.value, ErrorResponse) and result.final
    assert "no output for request 'r' for 1800 s" in result.value.error.message
    assert result.headers == {HEADER_ATTEMPT: "a1", HEADER_SEQ: "2", HEADER_FINAL: "1"}  # after seq 1's result
    assert cancel.request_id == "r"
    assert not derenderer.is_active("r") and derenderer.is_finished("r")
    assert run_chunks(derenderer, chunks[2:]) == []  # generate was only slow: no second final
    assert derenderer.end_stalled("r", 1800) == []  # not open: nothing
    assert derenderer.stats.stalled == 1


def test_a_stalled_request_s_restart_is_said_on_its_error_when_nothing_said_it_before(tiny_model_dir):
    # Not streamed: a restarted attempt's first chunk publishes nothing, so the error is
    # the first result of the new attempt and carries genpipe-restart.
    derenderer = Derenderer(str(tiny_model_dir))
    ids = encode_ids(derenderer.tables, "one two")
    output = OutputOptions(stream=False)
    assert run_chunks(derenderer, make_chunks("r", ids, output=output)[:1]) == []
    assert run_chunks(derenderer, make_chunks("r", ids, output=output, attempt="a2")[:1]) == []
    [result] = results(derenderer.end_stalled("r", 5))
    assert result.headers == {HEADER_ATTEMPT: "a2", HEADER_SEQ: "1", HEADER_FINAL: "1", HEADER_RESTART: "1"}
