"""The genpipe-* Kafka headers, by name (docs/design.md §2). `content-type` and
`genpipe-schema` belong to the codec (schemas/codec.py)."""

HEADER_ATTEMPT = "genpipe-attempt"  # results: the attempt (run) of the request they come from
HEADER_SEQ = "genpipe-seq"  # results: the chunk seq they render
HEADER_FINAL = "genpipe-final"  # "1" on a request's last result
HEADER_RESTART = "genpipe-restart"  # "1" on the first result of a new attempt
HEADER_ERROR = "genpipe-error"  # on an aborted request's last result: why (e.g. its deadline passed while queued)
HEADER_DLQ_TOPIC = "genpipe-dlq-source-topic"
HEADER_DLQ_PARTITION = "genpipe-dlq-source-partition"
HEADER_DLQ_OFFSET = "genpipe-dlq-source-offset"
HEADER_DLQ_ERROR = "genpipe-dlq-error"
HEADER_DLQ_TIME = "genpipe-dlq-time-ms"
HEADER_DLQ_CUT = "genpipe-dlq-cut"  # the copy was cut to fit the record limit: what the original held
