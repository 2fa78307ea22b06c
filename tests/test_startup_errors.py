"""A worker that cannot start says why in one line (exit 2: what the user gave; 1: run
time), never with a library's traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workers.cli import main


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_generate_worker_with_a_missing_model_directory(capsys):
    # Before: transformers' "Repo id must use alphanumeric chars..." at the end of a traceback.
    assert main(["generate-worker", "--model", "/nonexistent/model"]) == 2
    line = one_error_line(capsys)
    assert line.startswith("genpipe generate-worker: error: --model /nonexistent/model")
    assert "does not exist" in line


def test_generate_worker_with_a_directory_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["generate-worker", "--model", str(tmp_path)]) == 2
    assert "no config.json in it: not a Hugging Face model directory" in one_error_line(capsys)
    assert main(["generate-worker", "--model", str(tmp_path / "notes.txt")]) == 2
    assert "not a directory" in one_error_line(capsys)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads every file")
def test_generate_worker_with_an_unreadable_config(tmp_path, capsys):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "config.json").chmod(0)
    assert main(["generate-worker", "--model", str(tmp_path)]) == 2
    assert "not readable" in one_error_line(capsys)


def test_generate_worker_with_a_broken_model_is_one_runtime_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"model_type": "no-such-architecture"}')
    assert main(["generate-worker", "--model", str(tmp_path), "--engine-in", "thread",
                 "--bootstrap-servers", "127.0.0.1:1"]) == 1
    line = one_error_line(capsys)
    assert line.startswith(f"genpipe generate-worker: error: cannot load the model {tmp_path}:")


def test_generate_worker_on_cuda_without_a_gpu(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["generate-worker", "--device", "cuda"]) == 2
    assert "no CUDA GPU is visible" in one_error_line(capsys)
    assert main(["generate-worker", "--device", "tpu7"]) == 2
    assert "--device" in one_error_line(capsys)


@pytest.mark.parametrize("command", ["generate-worker", "derender-worker", "serve"])
def test_a_gc_tuning_setting_other_than_0_or_1_stops_the_command_at_start(command, monkeypatch, capsys):
    # Before: anything but "0" meant on, so a deployment's GENPIPE_GC_TUNING=false or off
    # tuned the collector while saying not to.
    monkeypatch.setenv("GENPIPE_GC_TUNING", "off")
    assert main([command, "--bootstrap-servers", "127.0.0.1:1"]) == 2  # before any connection
    assert one_error_line(capsys) == (f"genpipe {command}: error: GENPIPE_GC_TUNING='off': expected 1 (tune the "
                                      "garbage collector once up, the default) or 0 (keep Python's defaults)")


def test_derender_worker_with_a_model_path_that_is_not_there(capsys):
    assert main(["derender-worker", "--tokenizer", "path/to/model"]) == 2
    assert "--tokenizer path/to/model: the tokenizer directory does not exist" in one_error_line(capsys)


def test_derender_worker_with_an_unreachable_broker(tiny_model_dir):
    run = subprocess.run(
        [sys.executable, "-m", "workers.cli", "derender-worker", "--bootstrap-servers", "127.0.0.1:1",
         "--tokenizer", str(tiny_model_dir)],
        capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr
    assert "Traceback" not in run.stderr and "Unclosed" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.startswith("genpipe derender-worker: error:")]
    assert len(errors) == 1 and "cannot reach Kafka at 127.0.0.1:1" in errors[0], run.stderr


@pytest.mark.kafka
def test_a_worker_whose_topics_do_not_exist_says_so_at_start(kafka_settings, tiny_model_dir, capsys):
    # It used to start, and stop on its first publish to a missing topic (or wait forever).
    code = main(["derender-worker", "--bootstrap-servers", kafka_settings.bootstrap_servers,
                 "--topic-prefix", kafka_settings.topic_prefix, "--tokenizer", str(tiny_model_dir)])
    assert code == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    p = kafka_settings.topic_prefix
    assert errors == [
        f"genpipe derender-worker: error: topics {p}.chunks, {p}.results, {p}.cancel, {p}.dlq "
        f"do not exist on {kafka_settings.bootstrap_servers} (or this worker may not see them): create them "
        f"with `genpipe topics create --topic-prefix {p}`"]


@pytest.mark.kafka
def test_a_worker_whose_topic_refuses_its_largest_records_says_so_at_start(kafka_settings, make_topics,
                                                                           tiny_model_dir, capsys):
    """A results topic (or chunks, or DLQ) whose max.message.bytes is below what the worker
    writes there refuses those records for good, mid-stream: said at start instead."""
    import asyncio

    from tests.kafka_helpers import set_max_message_bytes

    async def prepare():
        await make_topics(kafka_settings, partitions=1)
        await set_max_message_bytes(kafka_settings, kafka_settings.topic("results"), 400_000)

    asyncio.run(prepare())
    common = ["derender-worker", "--bootstrap-servers", kafka_settings.bootstrap_servers,
              "--topic-prefix", kafka_settings.topic_prefix, "--tokenizer", str(tiny_model_dir)]
    assert main(common) == 1
    results = kafka_settings.topic("results")
    assert one_error_line(capsys) == (
        f"genpipe derender-worker: error: topic {results!r} takes record batches of at most 400000 bytes (its "
        f"max.message.bytes), below the 1000512 this worker may write there (--max-record-bytes 1000000, batches "
        f"of up to 262144 bytes): raise its max.message.bytes to 1000512 or more, or lower --max-record-bytes to "
        f"399488")


def test_record_limits_that_refuse_a_workers_records_or_batches_are_named_with_the_fix():
    from workers.broker.topics import record_limit_problems

    batch = 256 * 1024
    assert record_limit_problems({"p.results": 1_048_588, "p.dlq": 1_000_512}, 1_000_000, batch) == []
    # a lower --max-record-bytes fits a smaller topic, down to the producer's batch size
    assert record_limit_problems({"p.chunks": 300_000}, 200_000, batch) == []
    (problem,) = record_limit_problems({"p.chunks": 200_000, "p.results": 1_048_588}, 1_000_000, batch)
    assert problem.startswith("topic 'p.chunks' takes record batches of at most 200000 bytes")
    assert problem.endswith("raise its max.message.bytes to 1000512 or more")  # no --max-record-bytes fits it
