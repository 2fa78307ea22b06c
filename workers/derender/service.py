"""Wiring one derender worker process: tables + state machine + the shared loop."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Callable

from workers.derender.stalls import DEFAULT_STALLED_REQUEST_S
from workers.derender.state import DEFAULT_MODEL_NAME
from workers.derender.worker import DerenderHandler
from schemas.validation import DEFAULT_MAX_LOGPROBS
from workers.kafka.publisher import MAX_RECORD_BYTES
from workers.kafka.reply_topics import reply_topic_rule
from workers.kafka.runtime import serve
from workers.kafka.settings import KafkaSettings
from workers.startup import StartupError, one_line


@dataclass
class DerenderWorkerConfig:
    tokenizer: str | None = None  # None: the built-in tiny spm model's tokenizer
    model_name: str = DEFAULT_MODEL_NAME  # `model` in results when the request names none
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    group_id: str = "genpipe-derender"
    grace_s: float = 10.0
    commit_interval_s: float = 0.5
    max_record_bytes: int = MAX_RECORD_BYTES  # largest result record published (see publisher)
    reply_topic_pattern: str | None = None  # None: workers.kafka.reply_topics.DEFAULT_PATTERN
    stalled_request_s: float = DEFAULT_STALLED_REQUEST_S  # 0: never (workers/derender/stalls.py)


def load_derenderer(config: DerenderWorkerConfig):
    from workers.derender.state import Derenderer
    from workers.models.tinymodel import default_model_dir

    tokenizer = config.tokenizer or str(default_model_dir("spm"))
    try:
        return Derenderer(tokenizer, model_name=config.model_name, max_logprobs=config.max_logprobs,
                          max_result_bytes=config.max_record_bytes)
    except Exception as exc:
        raise StartupError(f"cannot load the tokenizer {tokenizer}: {type(exc).__name__}: {one_line(exc)}") from exc


async def run_derender_worker(settings: KafkaSettings, config: DerenderWorkerConfig, *,
                              stop: asyncio.Event | None = None,
                              on_ready: Callable[[], None] | None = None) -> int:
    derenderer = load_derenderer(config)
    rule = reply_topic_rule(settings.topic_prefix, config.reply_topic_pattern)

    def make_handler(publisher, offsets):
        return DerenderHandler(settings, publisher, offsets, derenderer, rule,
                               stalled_request_s=config.stalled_request_s)

    return await serve(settings, topic=settings.topic("chunks"), group_id=config.group_id,
                       make_handler=make_handler, stop=stop, grace_s=config.grace_s, on_ready=on_ready,
                       worker="derender", loop_options={"commit_interval_s": config.commit_interval_s},
                       max_record_bytes=config.max_record_bytes,
                       uses=[settings.topic("results"), settings.topic("cancel")],
                       writes=[settings.topic("results")])
