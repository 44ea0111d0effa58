"""A bare `jitllmd serve` (the embedded SmolLM2-135M-Instruct) answering the official OpenAI and Anthropic SDKs."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.serving import Server

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."


@pytest.fixture(scope="module")
def server(smollm2_gguf):
    s = Server("-max-seq", "2048")  # no -load: the embedded default
    yield s
    s.stop()


def test_openai_sdk_answers(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        [model] = client.models.list().data
        assert model.id.startswith("m-")
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=QUESTION, max_tokens=32, temperature=0)
        assert r.choices[0].message.content == ANSWER and r.choices[0].finish_reason == "stop"
        figures = r.model_extra["jitllm"]
        assert figures["host_blocks"] == 32 and figures["decode_tokens_per_second"] > 1
        streamed = client.chat.completions.create(model=model.id, messages=QUESTION, max_tokens=32, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == ANSWER


def test_anthropic_sdk_answers(server):
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        msg = client.messages.create(model="smollm2-135m-instruct", max_tokens=32, messages=QUESTION, extra_body={"temperature": 0})
        assert msg.content[0].text == ANSWER and msg.stop_reason == "end_turn"
        with client.messages.stream(model="smollm2-135m-instruct", max_tokens=32, messages=QUESTION, extra_body={"temperature": 0}) as stream:
            assert "".join(stream.text_stream) == ANSWER
