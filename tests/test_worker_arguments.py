"""The command lines refuse out-of-range numbers and unknown choices, given as flags or in
the environment, with one usage line (no broker)."""

from __future__ import annotations

import os

import pytest

from workers.cli import build_parser


def parse(argv: list[str]):
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("argv, message", [
    (["generate-worker", "--max-batch", "0"], "argument --max-batch: must be at least 1, got 0"),
    (["generate-worker", "--coalesce-max-tokens", "0"], "argument --coalesce-max-tokens: must be at least 1, got 0"),
    (["generate-worker", "--coalesce-max-delay-ms", "nan"], "argument --coalesce-max-delay-ms: must be at least 0.0"),
    (["generate-worker", "--saturated-stretch", "0.5"], "argument --saturated-stretch: must be at least 1.0, got 0.5"),
    (["generate-worker", "--prefill-chunk", "many"], "argument --prefill-chunk: expected an integer, got 'many'"),
    (["generate-worker", "--engine-stall-s", "-1"], "argument --engine-stall-s: must be at least 0.0, got -1"),
    (["generate-worker", "--engine-stall-s", "nan"], "argument --engine-stall-s: must be at least 0.0"),
    (["derender-worker", "--commit-interval-ms", "0"], "argument --commit-interval-ms: must be at least 1.0, got 0"),
    (["derender-worker", "--max-logprobs", "-2"], "argument --max-logprobs: must be at least -1, got -2"),
    # a mistyped address or port was a traceback from the client's first connection
    (["tail", "--bootstrap-servers", "kafka:9O92"], "argument --bootstrap-servers: expected host:port"),
    (["replay", "--from", "0", "--out", "-", "--bootstrap-servers", "127.0.0.1:99999"],
     "argument --bootstrap-servers: expected host:port[,host:port...] with ports 1..65535, got '127.0.0.1:99999'"),
    (["generate-worker", "--metrics-port", "70000"], "argument --metrics-port: must be a port number, at most 65535"),
    (["serve", "--port", "0"], "argument --port: must be at least 1, got 0"),
    (["submit", "--token-ids", "1", "--seed", str(2**70)], "argument --seed: must fit in 64 bits"),
])
def test_out_of_range_flags_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_environment_defaults_are_checked_like_flags(monkeypatch, capsys):
    monkeypatch.setenv("GENPIPE_MAX_BATCH", "zero")
    with pytest.raises(SystemExit):
        parse(["generate-worker"])
    assert "argument --max-batch: expected an integer, got 'zero'" in capsys.readouterr().err
    monkeypatch.setenv("GENPIPE_MAX_BATCH", "8")
    assert parse(["generate-worker"]).max_batch == 8


def test_a_mistyped_bootstrap_server_in_the_environment_is_a_usage_error(monkeypatch, capsys):
    monkeypatch.setenv("GENPIPE_BOOTSTRAP_SERVERS", "kafka-0:9092,kafka-1:9O92")
    with pytest.raises(SystemExit) as exit_info:
        parse(["submit", "--token-ids", "1"])
    assert exit_info.value.code == 2
    assert "argument --bootstrap-servers: expected host:port" in capsys.readouterr().err
    monkeypatch.setenv("GENPIPE_BOOTSTRAP_SERVERS", "kafka-0:9092, [::1]:9093,kafka-2,2001:db8::beef,::1")
    assert parse(["submit", "--token-ids", "1"]).bootstrap_servers == \
        "kafka-0:9092,[::1]:9093,kafka-2,2001:db8::beef,::1"


def test_defaults_and_good_values_parse_to_numbers(monkeypatch):
    for name in ("GENPIPE_MAX_BATCH", "GENPIPE_MAX_LOGPROBS"):
        monkeypatch.delenv(name, raising=False)
    args = parse(["generate-worker", "--coalesce-max-tokens", "4", "--min-step-ms", "20"])
    assert (args.max_batch, args.coalesce_max_tokens, args.min_step_ms, args.max_logprobs) == (32, 4, 20.0, 20)
    assert parse(["derender-worker", "--max-logprobs", "-1"]).max_logprobs == -1
    monkeypatch.delenv("GENPIPE_ENGINE_STALL_S", raising=False)
    assert parse(["generate-worker"]).engine_stall_s == 120.0
    monkeypatch.setenv("GENPIPE_ENGINE_STALL_S", "0")
    assert parse(["generate-worker"]).engine_stall_s == 0.0  # (off)


def test_replay_file_mode_and_submit_render_with_the_worker_s_tokenizer_and_model_name(monkeypatch, tmp_path):
    """`genpipe replay` and `genpipe derender` ignored GENPIPE_TOKENIZER and
    GENPIPE_MODEL_NAME, which the worker reads: run in a deployment's environment, a
    replay rendered a real model's ids with the tiny tokenizer (every request a bad
    chunk), and named another model."""
    monkeypatch.setenv("GENPIPE_TOKENIZER", str(tmp_path))
    monkeypatch.setenv("GENPIPE_MODEL_NAME", "llama-8b")
    worker = parse(["derender-worker"])
    for argv in (["replay", "--from", "0", "--out", "y"], ["derender", "--in", "x", "--out", "y"]):
        args = parse(argv)
        assert (args.tokenizer, args.model_name) == (worker.tokenizer, worker.model_name) == (str(tmp_path), "llama-8b")
    # and `genpipe submit` renders its prompt with it (it took the tiny model's ids to a
    # real model: an answer to another prompt, with no error)
    assert parse(["submit", "--prompt", "hi"]).tokenizer == str(tmp_path)


def test_event_loop_is_a_choice_checked_on_the_flag_and_the_environment(monkeypatch, capsys):
    monkeypatch.delenv("GENPIPE_EVENT_LOOP", raising=False)
    assert parse(["generate-worker"]).event_loop == "auto"
    assert parse(["derender-worker", "--event-loop", "asyncio"]).event_loop == "asyncio"
    with pytest.raises(SystemExit):
        parse(["derender-worker", "--event-loop", "uv"])
    assert "argument --event-loop: expected one of auto, uvloop, asyncio, got 'uv'" in capsys.readouterr().err
    monkeypatch.setenv("GENPIPE_EVENT_LOOP", "uvlop")  # a typo in a deployment's env: refused, not ignored
    with pytest.raises(SystemExit):
        parse(["generate-worker"])
    assert "got 'uvlop'" in capsys.readouterr().err


@pytest.mark.parametrize("variable, typo, argv, message", [
    # argparse checks choices= on flags only: these typos used to pass (the log level
    # silently became INFO, the dtype failed inside the engine child, the protocol inside
    # aiokafka). Each is now the same usage error as the flag's.
    ("GENPIPE_LOG_LEVEL", "loud", ["derender-worker"],
     "argument --log-level: expected one of DEBUG, INFO, WARNING, ERROR, got 'loud'"),
    ("GENPIPE_LOG_LEVEL", "verbose", ["serve"], "argument --log-level: expected one of DEBUG"),
    ("GENPIPE_DTYPE", "fp16", ["generate-worker"],
     "argument --dtype: expected one of float32, bfloat16, float16, got 'fp16'"),
    ("GENPIPE_CUDA_GRAPHS", "on", ["generate-worker"], "argument --cuda-graphs: expected one of auto, off, got 'on'"),
    ("GENPIPE_SECURITY_PROTOCOL", "TLS", ["tail"],
     "argument --security-protocol: expected one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL, got 'TLS'"),
])
def test_choices_from_the_environment_are_checked_like_flags(variable, typo, argv, message, monkeypatch, capsys):
    monkeypatch.setenv(variable, typo)
    with pytest.raises(SystemExit) as exit_info:
        parse(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_log_level_and_security_protocol_take_any_case(monkeypatch):
    monkeypatch.setenv("GENPIPE_LOG_LEVEL", "warning")
    monkeypatch.setenv("GENPIPE_SECURITY_PROTOCOL", "sasl_ssl")
    args = parse(["generate-worker"])
    assert (args.log_level, args.security_protocol) == ("WARNING", "SASL_SSL")
    assert parse(["derender-worker", "--log-level", "Debug"]).log_level == "DEBUG"
    monkeypatch.delenv("GENPIPE_DTYPE", raising=False)
    assert parse(["generate-worker"]).dtype == "float32"
    with pytest.raises(SystemExit):  # dtypes are names torch spells one way: not folded
        parse(["generate-worker", "--dtype", "BFloat16"])


def test_event_loop_factory_takes_uvloop_and_says_when_it_is_missing(monkeypatch):
    import sys

    import uvloop

    from workers.worker_commands import event_loop_factory

    assert event_loop_factory("auto") is uvloop.new_event_loop
    assert event_loop_factory("uvloop") is uvloop.new_event_loop
    assert event_loop_factory("asyncio") is None  # asyncio.Runner's default loop
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if not installed: import fails
    assert event_loop_factory("auto") is None
    with pytest.raises(SystemExit, match="uvloop is not installed"):
        event_loop_factory("uvloop")


def test_the_demo_hands_its_whole_kafka_connection_to_the_commands_it_starts(monkeypatch, tls_files):
    """`genpipe demo --security-protocol SASL_SSL --sasl-... --ssl-cafile ...` passed only
    --bootstrap-servers and --topic-prefix to its workers and gateway: the security
    options reached the demo's own client, and the workers could not log in. They go in
    the children's environment, which each command reads as its own flags' defaults."""
    from workers.demo import Children
    from workers.kafka.settings import KafkaSettings

    for name in [n for n in os.environ if n.startswith("GENPIPE_")]:
        monkeypatch.delenv(name)
    args = parse(["demo", "--bootstrap-servers", "k1:9093", "--topic-prefix", "acme", "--security-protocol",
                  "SASL_SSL", "--sasl-mechanism", "SCRAM-SHA-512", "--sasl-username", "u", "--sasl-password", "p",
                  "--ssl-cafile", str(tls_files["cert"]), "--ssl-password", "pw"])
    settings = KafkaSettings.from_args(args, client_id="genpipe-demo")
    children_env = Children(settings).env
    for name, value in children_env.items():
        if name.startswith("GENPIPE_"):
            monkeypatch.setenv(name, value)
    worker = KafkaSettings.from_args(parse(["derender-worker"]), client_id="genpipe-demo")
    assert worker == settings and worker.sasl_plain_password == "p" and worker.ssl_cafile == str(tls_files["cert"])
    assert worker.ssl_password == "pw"


def test_submit_chat_takes_only_a_chat_role_in_front():
    """`--chat "Q: what is 2+2?"` was sent as a message of role "Q", with no error."""
    args = parse(["submit", "--chat", "Q: what is 2+2?", "--chat", "System: be terse", "--chat", "assistant:hi"])
    assert args.chat == [{"role": "user", "content": "Q: what is 2+2?"}, {"role": "system", "content": "be terse"},
                         {"role": "assistant", "content": "hi"}]


def test_a_metrics_port_in_use_is_one_line_not_a_traceback():
    import socket
    import subprocess
    import sys
    from pathlib import Path

    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    try:
        out = subprocess.run([sys.executable, "-m", "workers.cli", "derender-worker", "--bootstrap-servers",
                              "127.0.0.1:1", "--metrics-port", str(taken.getsockname()[1])],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
    finally:
        taken.close()
    assert out.returncode == 2 and out.stderr.startswith("genpipe derender-worker: error: --metrics-port "), out.stderr
    assert "cannot serve metrics there" in out.stderr and len(out.stderr.splitlines()) == 1


def test_connection_settings_never_show_the_password():
    """A traceback's locals or a log line's %r of the settings showed the SASL password."""
    from workers.kafka.settings import KafkaSettings

    settings = KafkaSettings(sasl_plain_username="u", sasl_plain_password="s3cret")
    assert "s3cret" not in repr(settings) and "sasl_plain_username='u'" in repr(settings)


@pytest.fixture
def tls_files(tmp_path):
    """A self-signed certificate, its key encrypted with the passphrase "secret", and the
    same key unencrypted (openssl, as the secure test broker makes its own)."""
    import subprocess

    files = {"cert": tmp_path / "client.crt", "encrypted": tmp_path / "encrypted.key", "key": tmp_path / "plain.key"}
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-days", "1", "-subj", "/CN=genpipe-test",
                    "-keyout", str(files["encrypted"]), "-out", str(files["cert"]), "-passout", "pass:secret"],
                   check=True, capture_output=True, timeout=60)
    subprocess.run(["openssl", "pkey", "-in", str(files["encrypted"]), "-passin", "pass:secret", "-out",
                    str(files["key"])], check=True, capture_output=True, timeout=60)
    return files


def test_an_encrypted_client_key_without_its_passphrase_is_one_line_not_a_prompt(tls_files):
    """OpenSSL asked for the passphrase on the terminal, once per Kafka client a command
    made (a worker under a terminal waited there), and without one failed with "[Errno
    22] Invalid argument". It is a usage error now, at the command's start; the
    passphrase comes from --ssl-password or GENPIPE_SSL_PASSWORD."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if not k.startswith("GENPIPE_")}
    argv = [sys.executable, "-m", "workers.cli", "tail", "--bootstrap-servers", "127.0.0.1:1", "--security-protocol",
            "SSL", "--ssl-certfile", str(tls_files["cert"]), "--ssl-keyfile", str(tls_files["encrypted"])]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL, env=env,
                         start_new_session=True, cwd=Path(__file__).resolve().parents[1])  # (no terminal)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"genpipe tail: error: --ssl-certfile {tls_files['cert']} --ssl-keyfile {tls_files['encrypted']}: the "
        f"private key is encrypted: give its passphrase with --ssl-password (env GENPIPE_SSL_PASSWORD)"], out.stderr


def test_tls_files_a_command_cannot_use_are_named_at_its_start(tls_files, monkeypatch, tmp_path):
    from workers.kafka.settings import KafkaSettings
    from workers.startup import UsageError

    for name in [n for n in os.environ if n.startswith("GENPIPE_")]:
        monkeypatch.delenv(name)
    tls = ["--security-protocol", "SSL"]
    cert, encrypted = str(tls_files["cert"]), str(tls_files["encrypted"])
    good = KafkaSettings.from_args(parse(["tail", *tls, "--ssl-cafile", cert, "--ssl-certfile", cert,
                                          "--ssl-keyfile", encrypted, "--ssl-password", "secret"]))
    assert good.client_kwargs()["ssl_context"] is not None
    assert "secret" not in repr(good) and good.to_env()["GENPIPE_SSL_PASSWORD"] == "secret"
    assert KafkaSettings.from_args(parse(["tail", *tls, "--ssl-certfile", cert, "--ssl-keyfile",
                                          str(tls_files["key"])])).ssl_password is None
    monkeypatch.setenv("GENPIPE_SSL_PASSWORD", "secret")  # (as the demo hands it to its children)
    assert KafkaSettings.from_args(parse(["tail", *tls, "--ssl-certfile", cert, "--ssl-keyfile", encrypted]))
    monkeypatch.delenv("GENPIPE_SSL_PASSWORD")

    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    for argv, message in [
        (["--ssl-cafile", str(tmp_path / "missing.pem")],
         f"--ssl-cafile {tmp_path / 'missing.pem'}: not a readable PEM file of CA certificates (No such file"),
        (["--ssl-cafile", str(garbage)], f"--ssl-cafile {garbage}: not a readable PEM file of CA certificates"),
        (["--ssl-certfile", cert, "--ssl-keyfile", encrypted, "--ssl-password", "wrong"],
         f"--ssl-certfile {cert} --ssl-keyfile {encrypted}: cannot load the client certificate and its key"),
        (["--ssl-certfile", str(garbage)], f"--ssl-certfile {garbage}: cannot load the client certificate"),
        (["--ssl-keyfile", encrypted], f"--ssl-keyfile {encrypted} is given without --ssl-certfile"),
    ]:
        with pytest.raises(UsageError) as err:
            KafkaSettings.from_args(parse(["tail", *tls, *argv]))
        assert str(err.value).startswith(message), str(err.value)
    wrong = parse(["tail", *tls, "--ssl-certfile", cert, "--ssl-keyfile", encrypted, "--ssl-password", "wrong"])
    with pytest.raises(UsageError, match="or a wrong --ssl-password"):
        KafkaSettings.from_args(wrong)
    # (not checked, nor needed, without TLS)
    assert KafkaSettings.from_args(parse(["tail", "--ssl-cafile", str(garbage)])).ssl_cafile == str(garbage)
