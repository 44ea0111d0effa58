"""OpenAI's own OpenAPI document fuzzes the operations a real server answers (schemathesis): no 5xx, and every answer
is what the document describes.

Cases come from `../shared/spec/openai-openapi.yaml`, restricted to the six operations served: chat completions,
completions, embeddings (a 400 here: the tiny model generates text), the model list, one model, and responses (its
tidied cases keep function tools only, a string input, and none of background, conversation, prompt, truncation or
text; its streams are checked event by event against ResponseStreamEvent, numbered from 0). Its paths hang off
`servers: https://api.openai.com/v1`, so the base URL is the server's `/v1`. Each (operation, positive or negative
mode) gets a share of `--fuzz-cases` (300 by default; a larger count such as 3000 is the long run), derandomized, so
a run sends the same requests every time.

Steering, per case (`steer`, its choices drawn by hypothesis): about 7 in 8 name the served model "tiny" (the rest
keep the generated name and mostly meet the 404); `max_tokens`/`max_completion_tokens` are always clamped to 16, and set
to 16 when absent or null, since without one a reply runs until the context is full; about 1 in 3 generation cases ask
for a stream (the generator alone almost never does); `n` is capped at 3. About 3 in 4 are also tidied of what the
server declines by design with a 400 (`best_of`, `suffix`, `response_format`, `stream_options` without `stream`, legacy
`function` messages and `function_call`, token ids past the vocabulary, a null prompt), so most cases reach the
engine. The fuzz found two 500s (a `top_p` or `temperature` smaller than float32 holds);
`test_extreme_sampling_values_answer_200` keeps them fixed. Every case sends
an `Authorization` header, as SDKs do: without it the negative mode spends its cases on the missing API key, which the
server does not check.

Checks: schemathesis's `not_a_server_error`, `content_type_conformance`, `response_headers_conformance` and
`response_schema_conformance` on every answer; on top, a non-200 must be a 4xx whose body is the document's own
`ErrorResponse`, and a stream must be `data:` events ending in `[DONE]`, none an error, each valid against the
document's chunk schema. Relaxed, and why:
- `status_code_conformance` is off: the document lists only 200 and 429 for these operations, no 400 or 404, so every
  rejected request would fail it; the 4xx check above replaces it.
- `positive_data_acceptance` is off: the server implements a documented subset (no constrained decoding, no audio or
  image parts, embeddings only on an embedding model) and answers the rest with a 400.
- `negative_data_rejection` is off: the server reads only the fields it implements and ignores the others, so a
  schema-invalid value in an ignored field (`audio`, `prediction`, `metadata`, `functions`...) is accepted.
- `response_schema_conformance` is skipped for event streams and the chunks are checked here instead: for a
  pre-3.2 document schemathesis validates each SSE event's envelope (`{"data": "...", "event": "message"}`) against
  the schema, which describes the JSON inside `data`.
- `content_type_conformance` is skipped for streamed completions: the document lists only application/json for
  createCompletion, though its own `stream: true` answers text/event-stream.
- Streamed completion chunks are checked against `CreateCompletionResponse` (the document says streamed and whole
  completions share it) with `finish_reason` allowed null, as OpenAI sends it on every chunk but the last, and `usage`
  allowed null, as OpenAI sends it on every chunk but the usage one under `include_usage` (the chat chunk schema
  declares both nullable).
- Completions' `logprobs.token_logprobs` and `top_logprobs` items may be null: an echoed prompt's first token has no
  log probability, and OpenAI (and vLLM) send null there, which the document's items do not allow.
- The document still uses OpenAPI 3.0's `nullable: true`; schemathesis honours it, and so does the chunk and error
  validation here (`nullable`).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
)

from .conftest import VOCAB
from .openapi import SPEC, Schemas, nullable

SHARES = {  # (operationId, mode): share of --fuzz-cases; the GETs have nothing to negate once Authorization is sent
    ("createChatCompletion", "positive"): 0.35,
    ("createChatCompletion", "negative"): 0.15,
    ("createCompletion", "positive"): 0.20,
    ("createCompletion", "negative"): 0.10,
    ("createEmbedding", "positive"): 0.07,
    ("createEmbedding", "negative"): 0.03,
    ("listModels", "positive"): 0.02,
    ("retrieveModel", "positive"): 0.08,
    ("createResponse", "positive"): 0.10,
    ("createResponse", "negative"): 0.04,
}
CHUNK_SCHEMAS = {"createChatCompletion": "CreateChatCompletionStreamResponse", "createCompletion": "CompletionChunk",
                 "createResponse": "ResponseStreamEvent"}
CHECKS = [not_a_server_error, content_type_conformance, response_headers_conformance, response_schema_conformance]
AUTH = {"Authorization": "Bearer unused"}
MAX_TOKENS = 16
DECLINED = ("best_of", "suffix", "response_format")
DECLINED_RESPONSES = ("background", "conversation", "prompt", "truncation", "text")  # and tools other than functions
MAX_N = 3  # choices: each costs its max_tokens
SLOW_SERVER = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large, HealthCheck.large_base_example]


class Payloads(Schemas):
    """Validators for JSON the schemathesis checks do not reach: error bodies and stream chunks, from the document."""

    def __init__(self, raw: dict[str, Any]):
        chunk = copy.deepcopy(nullable(raw["components"]["schemas"]["CreateCompletionResponse"]))
        choice = chunk["properties"]["choices"]["items"]["properties"]
        choice["finish_reason"] = {"anyOf": [choice["finish_reason"], {"type": "null"}]}
        chunk["properties"]["usage"] = {"anyOf": [chunk["properties"]["usage"], {"type": "null"}]}
        super().__init__(raw, {"CompletionChunk": chunk})


@pytest.fixture(scope="module")
def openai_schema():
    """OpenAI's document; failure reports show the requests unredacted."""
    if not SPEC.exists():
        pytest.skip(f"OpenAI's OpenAPI document is not at {SPEC}")
    # every event of a stream is read (schemathesis stops at 20 by default: n choices of several prompts have more)
    config = schemathesis.Config.from_dict({"output": {"sanitization": {"enabled": False}}, "max-stream-events": 10_000})
    raw = yaml.safe_load(SPEC.read_text())
    logprobs = raw["components"]["schemas"]["CreateCompletionResponse"]["properties"]["choices"]["items"]["properties"]["logprobs"]
    for option in logprobs["anyOf"]:
        for key in ("token_logprobs", "top_logprobs"):  # an echoed prompt's first token has none: null, as OpenAI sends
            if key in option.get("properties", {}):
                option["properties"][key]["items"]["nullable"] = True
    return schemathesis.openapi.from_dict(raw, config=config)


@pytest.fixture(scope="module")
def served(openai_schema) -> dict[str, Any]:
    """The document's operations that the server answers, by operationId."""
    operations = openai_schema.include(operation_id=sorted({op for op, _ in SHARES})).get_all_operations()
    return {op.definition.raw["operationId"]: op for op in (r.ok() for r in operations)}


@pytest.fixture(scope="module")
def payloads(openai_schema) -> Payloads:
    return Payloads(openai_schema.raw_schema)


def steer(case: Any, name: bool, tidy: bool, stream: bool) -> Any:
    """Point a generated case at the served model, keep its generation short, (stream) ask for a stream, and (tidy)
    drop what the server declines by design."""
    if name and "model" in (case.path_parameters or {}):
        case.path_parameters["model"] = "tiny"
    body = case.body
    if not isinstance(body, dict):
        return case
    if name:
        body["model"] = "tiny"
    if stream:
        body["stream"] = True
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and body["n"] > MAX_N:
        body["n"] = MAX_N
    responses = case.operation.path == "/responses"
    for key in ["max_output_tokens"] if responses else [k for k in ("max_tokens", "max_completion_tokens") if k in body] or ["max_tokens"]:
        value = body.get(key)
        if value is None or (isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_TOKENS):
            body[key] = MAX_TOKENS
    if tidy:
        _tidy_responses(body) if responses else _tidy(body)
    return case


def _tidy_responses(body: dict[str, Any]) -> None:
    for key in DECLINED_RESPONSES:
        body.pop(key, None)
    if isinstance(body.get("tools"), list):
        body["tools"] = [t for t in body["tools"] if isinstance(t, dict) and t.get("type") == "function"]
    if not isinstance(body.get("input"), str):
        body["input"] = "Once upon a time"


def _tidy(body: dict[str, Any]) -> None:
    for key in DECLINED:
        body.pop(key, None)
    if body.get("stream") is not True:
        body.pop("stream_options", None)
    if isinstance(body.get("messages"), list):
        messages = [m for m in body["messages"] if not (isinstance(m, dict) and m.get("role") == "function")]
        for m in messages:
            if isinstance(m, dict):
                m.pop("function_call", None)
        body["messages"] = messages
    if "prompt" in body:
        prompt = body["prompt"]
        ids = lambda p: isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or ids(p) for p in prompt) and not ids(prompt):
            prompt = [[t % VOCAB for t in p] if ids(p) else p for p in prompt[:3]]  # several prompts: at most 3
            prompt = [p for p in prompt if p] or "Once upon a time"
        elif ids(prompt):
            prompt = [t % VOCAB for t in prompt]
        body["prompt"] = prompt or "Once upon a time"


def _header(response: Any, name: str) -> str:
    return (response.headers.get(name) or [""])[0]


def check_answer(case: Any, response: Any, base_url: str, operation_id: str, payloads: Payloads) -> None:
    """No 5xx; a 200 as the document describes it (whole or streamed); anything else a 4xx in OpenAI's error shape."""
    stream = _header(response, "content-type").startswith("text/event-stream")
    skipped = [response_schema_conformance] if stream else []
    if stream and operation_id == "createCompletion":
        skipped.append(content_type_conformance)

    case.validate_response(response, checks=CHECKS, excluded_checks=skipped)
    request = case.as_curl_command(base_url=base_url)
    status = response.status_code
    if status == 200:
        if stream and operation_id == "createResponse":
            check_response_stream(response.text, payloads, request)
        elif stream:
            check_stream(response.text, CHUNK_SCHEMAS[operation_id], payloads, request)
        return
    assert 400 <= status < 500, f"{status} {response.text}\n{request}"
    assert _header(response, "content-type") == "application/json", f"{status} {response.text}\n{request}"
    payloads.validate("ErrorResponse", response.json(), request)


def check_stream(text: str, chunk_schema: str, payloads: Payloads, request: str) -> None:
    data = [line.removeprefix("data:").strip() for line in text.splitlines() if line.startswith("data:")]
    assert data and data[-1] == "[DONE]", f"the stream does not end in [DONE]: {text[-300:]}\n{request}"
    for item in data[:-1]:
        chunk = json.loads(item)
        assert "error" not in chunk, f"the stream failed: {item}\n{request}"
        payloads.validate(chunk_schema, chunk, request)


def check_response_stream(text: str, payloads: Payloads, request: str) -> None:
    """A Responses stream: `event:` and `data:` pairs, each event one the document describes, numbered from 0, ending
    in response.completed or response.incomplete."""
    data = [json.loads(line.removeprefix("data:").strip()) for line in text.splitlines() if line.startswith("data:")]
    assert data and data[-1]["type"] in ("response.completed", "response.incomplete"), f"the stream does not end: {text[-300:]}\n{request}"
    assert [ev["sequence_number"] for ev in data] == list(range(len(data))), request
    for event in data:
        payloads.validate("ResponseStreamEvent", event, request)


@pytest.mark.parametrize(("operation_id", "mode"), list(SHARES), ids=[f"{op}-{mode}" for op, mode in SHARES])
def test_served_operations_conform(tiny_server, served, payloads, request, operation_id, mode):
    """Generated requests (steered to the tiny model) never meet a 5xx and get answers the document describes."""
    assert set(served) == {op for op, _ in SHARES}
    operation = served[operation_id]
    num_cases = max(1, round(request.config.getoption("--fuzz-cases") * SHARES[operation_id, mode]))
    base_url = tiny_server.url + "/v1"
    cases = st.builds(
        steer,
        operation.as_strategy(generation_mode=GenerationMode(mode), headers=AUTH),
        name=st.sampled_from([True] * 7 + [False]),
        tidy=st.sampled_from([True] * 3 + [False]),
        stream=st.sampled_from([False, False, True]) if operation_id in CHUNK_SCHEMAS else st.just(False),
    )

    @settings(max_examples=num_cases, derandomize=True, database=None, deadline=None, suppress_health_check=SLOW_SERVER)
    @given(case=cases)
    def fuzz(case):
        response = case.call(base_url=base_url, timeout=120)
        check_answer(case, response, base_url, operation_id, payloads)

    fuzz()


HI = [{"role": "user", "content": "hi"}]
EXTREMES = [  # the fuzz found these 500s (a top_p or temperature below what float32 holds); they stay fixed
    pytest.param(
        [("/v1/completions", {"model": "tiny", "prompt": [88, 4, 59, 95], "max_tokens": 16, "top_p": 4.846620955025621e-175}),
         ("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 4, "top_p": 1e-300})],
        id="top_p-under-float32",
    ),
    pytest.param(
        [("/v1/completions", {"model": "tiny", "prompt": [53, 44, 48, 44], "max_tokens": 16, "temperature": 1.496433681069533e-193,
                              "top_p": 1.4e-45, "presence_penalty": 0.5905914587739782}),
         ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 16, "temperature": 1e-40, "top_p": 0.5}),
         ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 16, "temperature": 1e-40, "min_p": 0.1}),
         ("/v1/chat/completions", {"model": "tiny", "messages": HI, "max_tokens": 4, "temperature": 1e-40, "top_p": 0.5})],
        id="temperature-under-float32",
    ),
]


@pytest.mark.parametrize("requests", EXTREMES)
def test_extreme_sampling_values_answer_200(tiny_server, requests):
    """A top_p or temperature in the document's range, however small, samples (the likeliest token) rather than fails."""
    for path, body in requests:
        r = httpx.post(tiny_server.url + path, json=body, timeout=60)
        assert r.status_code == 200 and b'"error"' not in r.content, f"{path} {json.dumps(body)}: {r.status_code} {r.text}"
