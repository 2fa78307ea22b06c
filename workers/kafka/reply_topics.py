"""Which topics a request may name as its `reply_topic` (docs/design.md, "Security").

A request's `reply_topic` is written by a client, so it is hostile until checked: without
a rule, any client could make the derender workers write results into the deployment's
own input topics, another deployment's topics, or (with broker auto-create on) new
topics. Both workers apply the same pure rule: generate answers a request that breaks it
with an `invalid_request_error` on the default results topic, and derender checks chunks
again before it publishes (defence in depth: a chunk may come from elsewhere).

The default allows `<prefix>.results` and `<prefix>.reply.<anything>`: a tenant gets a
private reply topic by creating `<prefix>.reply.<tenant>` and, with broker ACLs, reading
rights on it for that tenant alone (README, "Security").
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass

from workers.kafka.settings import TOPIC_ROLES

log = logging.getLogger(__name__)
DEFAULT_PATTERN = r"{prefix}\.results|{prefix}\.reply\..+"
_TOPIC_NAME = re.compile(r"[A-Za-z0-9._-]{1,249}")


class ReplyTopicPatternError(ValueError):
    """A configured pattern that is not a regular expression."""


@dataclass(frozen=True)
class ReplyTopicRule:
    prefix: str
    pattern: str  # as configured, with {prefix} in it
    compiled: re.Pattern
    own_topics: frozenset[str]  # never a reply topic, whatever the pattern says

    def problem(self, topic: str) -> str | None:
        """Why `topic` may not be a reply topic (one sentence naming the parameter), or None."""
        if not _TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):  # (Kafka refuses those two)
            return f"reply_topic is not a valid Kafka topic name: {topic[:300]!r}"
        if topic in self.own_topics:
            return (f"reply_topic {topic!r} is one of this deployment's own topics; results go to "
                    f"{self.prefix}.results or a topic matching {self.pattern.replace('{prefix}', self.prefix)!r}")
        if not self.compiled.fullmatch(topic):
            return (f"reply_topic {topic!r} is not allowed by this deployment: it must match "
                    f"{self.pattern.replace('{prefix}', self.prefix)!r} (leave it out to get results "
                    f"on {self.prefix}.results)")
        return None


def reply_topic_rule(prefix: str, pattern: str | None = None) -> ReplyTopicRule:
    """The rule for a deployment; `{prefix}` in `pattern` stands for the topic prefix
    (escaped). Raises ReplyTopicPatternError for a pattern that does not compile."""
    pattern = pattern or DEFAULT_PATTERN
    try:
        compiled = re.compile(pattern.replace("{prefix}", re.escape(prefix)))
    except re.error as exc:
        raise ReplyTopicPatternError(f"--reply-topic-pattern {pattern!r} is not a regular expression: {exc}") from None
    own = frozenset(f"{prefix}.{role}" for role in TOPIC_ROLES if role != "results")
    return ReplyTopicRule(prefix, pattern, compiled, own)


def check_client_reply_topic(topic: str, prefix: str, warn: bool = True) -> None:
    """A client's own reply topic (`GenpipeClient`, `genpipe submit`): one no worker can
    answer on (not a topic name, or one of the deployment's own topics) is a ValueError;
    one the workers' default `--reply-topic-pattern` refuses is a warning, as a deployment
    may set another: a refused topic's answers go to the results topic as errors, and the
    client waited its whole timeout for each request before saying where to look. The
    pattern is GENPIPE_REPLY_TOPIC_PATTERN where the client's environment has the workers'
    (else their default). `warn=False`: the ValueError only."""
    results = f"{prefix}.results"
    rule = reply_topic_rule(prefix, os.environ.get("GENPIPE_REPLY_TOPIC_PATTERN") or None)
    if topic in rule.own_topics:
        raise ValueError(f"reply_topic {topic!r} is one of the deployment's own topics: no worker answers there; "
                         f"leave it out to read {results}, or name {prefix}.reply.<name>")
    invalid = reply_topic_rule(prefix, ".+").problem(topic)  # (refused whatever the pattern)
    if invalid is not None:
        raise ValueError(invalid)
    if not warn or rule.problem(topic) is None:
        return
    if rule.pattern == DEFAULT_PATTERN:
        log.warning("reply_topic %r does not match the workers' default --reply-topic-pattern (%s): unless this "
                    "deployment's pattern allows it, every answer goes to %s as an error and this client waits its "
                    "timeout for each request; %s.reply.<name> is allowed by default", topic,
                    rule.compiled.pattern, results, prefix)
    else:
        log.warning("reply_topic %r does not match GENPIPE_REPLY_TOPIC_PATTERN (%s), the workers' "
                    "--reply-topic-pattern where they share this environment: every answer then goes to %s as an "
                    "error and this client waits its timeout for each request", topic, rule.compiled.pattern, results)
