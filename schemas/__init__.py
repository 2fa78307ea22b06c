"""genpipe's record contract: msgspec Structs, codecs and validation.

Imports neither Kafka nor torch; other languages get the same contract from
`genpipe schema export DIR` (JSON Schema per topic).
"""

from schemas.codec import (
    HEADER_CONTENT_TYPE,
    HEADER_SCHEMA,
    JSON,
    MSGPACK,
    Headers,
    content_type_of,
    decode,
    decode_record,
    encode,
    header_value,
    headers_for,
    peek_address,
    peek_request_id,
    schema_header,
)
from schemas.errors import DecodeError, RecordError, ValidationError
from schemas.openai import (
    ChatCompletion,
    ChatCompletionChoice,
    ChatCompletionChunk,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionStreamChoice,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogProbs,
    DeltaMessage,
    ErrorInfo,
    ErrorResponse,
    OpenAIResult,
    UsageInfo,
)
from schemas.records import (
    SCHEMA_VERSION,
    Cancel,
    ChunkError,
    GenerateChunk,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateLogProbsContent,
    GenerateRequest,
    OutputOptions,
    SamplingParams,
)
from schemas.validation import DEFAULT_MAX_LOGPROBS, validate_request

__all__ = [name for name in dir() if not name.startswith("_")]
