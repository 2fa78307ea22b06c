"""`genpipe derender --in CHUNKS --out RESULTS` end to end, files and stdin/stdout."""

from __future__ import annotations

import io
import json
import sys

import msgspec

from tests.derender_support import encode_ids, make_chunks, openai_validate, position, tables_for, tokenizer_dir
from schemas.codec import JSON, decode, encode
from schemas.openai import ChatCompletionChunk, Completion
from schemas.records import Cancel, OutputOptions
from workers import cli


def chunk_lines(kind="spm") -> list[str]:
    tables = tables_for(kind)
    lines = []
    ids = encode_ids(tables, " hello 中文 world")
    a = make_chunks("req-a", ids, output=OutputOptions(kind="chat", stream=True, top_logprobs=2),
                    positions=[position(i, [i, 5, 6]) for i in ids], prompt_tail=encode_ids(tables, "x"))
    b = make_chunks("req-b", ids, [len(ids)], output=OutputOptions(stop=["中"]), prompt_tail=encode_ids(tables, "x"),
                    finish_reason=None)
    # Interleave the two requests, as a partition would.
    for i, c in enumerate(a):
        lines.append(json.dumps({"key": c.request_id, "value": json.loads(encode(c, JSON))}))
        if i == 1:
            lines.append(json.dumps({"key": "req-b", "value": json.loads(encode(b[0], JSON))}))
    return lines


def read_out(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_files_end_to_end(tmp_path, capsys):
    src, dst, cx = tmp_path / "chunks.jsonl", tmp_path / "results.jsonl", tmp_path / "cancels.jsonl"
    src.write_text("\n".join(chunk_lines()) + "\n")
    rc = cli.main(["derender", "--in", str(src), "--out", str(dst), "--tokenizer", str(tokenizer_dir("spm")),
                   "--model-name", "tiny", "--cancels", str(cx)])
    assert rc == 0
    recs = read_out(dst.read_text())
    keys = [r["key"] for r in recs]
    assert keys[:2] == ["req-a", "req-a"] and keys[2] == "req-b" and set(keys[3:]) == {"req-a"}
    for r in recs:
        value = msgspec.json.decode(json.dumps(r["value"]).encode(), type=ChatCompletionChunk | Completion)
        openai_validate(value)
        assert r["headers"]["content-type"] == "application/json"
        assert r["headers"]["genpipe-schema"] == f"{type(value).__name__}/v1"
        assert r["value"]["model"] == "tiny"
    a = [r for r in recs if r["key"] == "req-a"]
    assert "".join(r["value"]["choices"][0]["delta"]["content"] for r in a) == " hello 中文 world"
    assert a[-1]["headers"]["genpipe-final"] == "1"
    (b,) = [r for r in recs if r["key"] == "req-b"]
    assert b["value"]["choices"][0] == {"index": 0, "text": " hello ", "logprobs": None, "finish_reason": "stop"}
    (cancel,) = read_out(cx.read_text())
    assert decode(json.dumps(cancel["value"]).encode(), Cancel, JSON).request_id == "req-b"
    err = capsys.readouterr().err
    assert "0 bad lines" in err and "0 unfinished" in err


def test_bad_lines_reported_and_skipped(tmp_path, capsys):
    lines = chunk_lines()
    lines.insert(1, "not json at all")
    lines.insert(3, json.dumps({"key": "req-a", "value": {"request_id": "req-a", "attempt": "a1", "seq": "x"}}))
    lines.insert(4, "")
    lines.insert(5, json.dumps({"key": "other", "value": json.loads(lines[0])["value"]}))
    long_id = "L" * 2000  # (a worker sends it to the DLQ)
    lines.append(json.dumps({"key": long_id, "value": {**json.loads(lines[0])["value"], "request_id": long_id}}))
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n")
    rc = cli.main(["derender", "--in", str(src), "--out", str(dst), "--tokenizer", str(tokenizer_dir("spm"))])
    assert rc == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"genpipe derender: {src}:2: not JSON")
    assert err[1].startswith(f"genpipe derender: {src}:4: seq: expected int")
    assert err[2].startswith(f"genpipe derender: {src}:6: key 'other' is not the chunk's request_id")
    assert err[3].startswith(f"genpipe derender: {src}:{len(lines)}: request_id of 2000 characters")
    assert "4 bad lines" in err[-1]
    recs = read_out(dst.read_text())
    assert "".join(r["value"]["choices"][0]["delta"]["content"] for r in recs if r["key"] == "req-a") \
        == " hello 中文 world"


def test_stdin_stdout(monkeypatch, capsys):
    data = ("\n".join(chunk_lines("bytelevel")) + "\n").encode()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data)))
    rc = cli.main(["derender", "--in", "-", "--out", "-", "--tokenizer", str(tokenizer_dir("bytelevel"))])
    assert rc == 0
    out = capsys.readouterr().out
    recs = read_out(out)
    assert "".join(r["value"]["choices"][0]["delta"]["content"] for r in recs if r["key"] == "req-a") \
        == " hello 中文 world"


def test_default_tokenizer_is_tiny_spm(tmp_path, monkeypatch, capsys):
    import workers.models.tinymodel as tiny

    calls = []

    def fake_default(kind="spm"):
        calls.append(kind)
        return tokenizer_dir("spm")

    monkeypatch.setattr(tiny, "default_model_dir", fake_default)
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(chunk_lines()) + "\n")
    assert cli.main(["derender", "--in", str(src), "--out", str(tmp_path / "o.jsonl")]) == 0
    assert calls == ["spm"]


def test_missing_tokenizer_and_input(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("")
    assert cli.main(["derender", "--in", str(src), "--tokenizer", str(tmp_path / "none")]) == 2
    assert "cannot load tokenizer" in capsys.readouterr().err
    assert cli.main(["derender", "--in", str(tmp_path / "missing.jsonl"),
                     "--tokenizer", str(tokenizer_dir("spm"))]) == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_a_result_over_the_record_limit_becomes_the_worker_s_error(tmp_path, capsys):
    """File mode wrote a result of any size, where a worker (and `genpipe replay`) puts
    the error result in its place: not the records a worker publishes, as it promises."""
    tables = tables_for("spm")
    ids = encode_ids(tables, " hello world") * 30
    big = make_chunks("big", ids, [len(ids)], output=OutputOptions(kind="completion", top_logprobs=3),
                      positions=[position(i, [i, 5, 6, 7]) for i in ids])
    src, dst = tmp_path / "chunks.jsonl", tmp_path / "results.jsonl"
    src.write_text(json.dumps({"key": "big", "value": json.loads(encode(big[0], JSON))}) + "\n")
    argv = ["derender", "--in", str(src), "--out", str(dst), "--tokenizer", str(tokenizer_dir("spm"))]
    assert cli.main(argv) == 0
    (whole,) = read_out(dst.read_text())
    size = len(json.dumps(whole["value"]))
    assert cli.main(argv + ["--max-record-bytes", str(size // 2)]) == 0
    (error,) = read_out(dst.read_text())
    assert "result too large" in error["value"]["error"]["message"] and error["headers"]["genpipe-final"] == "1"


def test_file_mode_says_how_many_lines_its_log_held_back(tmp_path, caplog):
    """A client's requests answered with an error go through a digest (the first 10 of
    every 10 s in full, then a count): file mode never said the count, 25 such requests
    made 10 lines and nothing more."""
    tables = tables_for("spm")
    ids = encode_ids(tables, " hello world") * 30
    lines = []
    for n in range(25):
        (big,) = make_chunks(f"big-{n}", ids, [len(ids)], output=OutputOptions(kind="completion", top_logprobs=3),
                             positions=[position(i, [i, 5, 6, 7]) for i in ids])
        lines.append(json.dumps({"key": big.request_id, "value": json.loads(encode(big, JSON))}))
    src = tmp_path / "chunks.jsonl"
    src.write_text("\n".join(lines) + "\n")
    assert cli.main(["derender", "--in", str(src), "--out", str(tmp_path / "r.jsonl"), "--tokenizer",
                     str(tokenizer_dir("spm")), "--max-record-bytes", "2000"]) == 0
    said = [r.getMessage() for r in caplog.records if "result too large" in r.getMessage()]
    assert len(said) == 11 and said[-1].startswith("15 more requests answered with an error in the last ")


def test_a_file_given_as_both_input_and_output_is_refused_untouched(tmp_path, capsys):
    """`--in F --out F` opened the output first: the input was emptied, read as empty,
    and the run said "0 chunks -> 0 results" with exit 0 (the chunks were lost)."""
    src = tmp_path / "chunks.jsonl"
    src.write_text("\n".join(chunk_lines()) + "\n")
    before = src.read_bytes()
    for argv, said in ((["--out", str(src)], "--in and --out name the same file"),
                       (["--out", str(tmp_path / "r.jsonl"), "--cancels", str(tmp_path / "r.jsonl")],
                        "--out and --cancels name the same file"),
                       (["--out", str(tmp_path / "." / "chunks.jsonl")], "--in and --out name the same file")):
        rc = cli.main(["derender", "--in", str(src), "--tokenizer", str(tokenizer_dir("spm")), *argv])
        assert rc == 2 and said in capsys.readouterr().err
    assert src.read_bytes() == before and not (tmp_path / "r.jsonl").exists()
    # a device may be named twice
    assert cli.main(["derender", "--in", str(src), "--tokenizer", str(tokenizer_dir("spm")), "--out", "/dev/null",
                     "--cancels", "/dev/null"]) == 0
