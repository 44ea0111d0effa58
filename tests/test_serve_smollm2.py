"""A bare `jitllmd serve` (the embedded SmolLM2-135M-Instruct) answering the official OpenAI and Anthropic SDKs."""

from __future__ import annotations

import time

import anthropic
import openai
import pytest

from jitllmd.engine.kernels.ops import bf16_units
from tests.serving import Server

pytestmark = pytest.mark.slow

# The greedy answer, fed whole and again after its cached prefix: where a prompt's products round x to bf16 (CPUs with
# bf16 units), and where they round it to int8 per 32 inputs as llama.cpp does (AVX2, AVX-512 VNNI), on which the
# France question's last prompt position is a near tie that goes to "L'Étoile, ..." as it does for llama.cpp
# (test_quant_models.py).
def question_and_answer() -> tuple[list[dict[str, str]], str]:
    """For the kernels the server's model was loaded with (this process's: it serves in-process)."""
    if bf16_units() is not None:
        return [{"role": "user", "content": "What is the capital of France?"}], "The capital of France is Paris."
    return [{"role": "user", "content": "What is 2 + 2?"}], "The answer is 4."


def _fallen_below(rss, mb: float) -> float:
    """RSS (MB) once it is below `mb`. An unloaded model's memory goes back when its last stream lets go of the engine;
    the timeout only bounds that wait."""
    deadline = time.monotonic() + 120
    while (now := rss()) >= mb:
        assert time.monotonic() < deadline, f"RSS stayed at {now:.0f} MB, not below {mb:.0f} MB"
        time.sleep(0.1)
    return now


@pytest.fixture(scope="module")
def server(serve, smollm2_gguf):
    return serve("-max-seq", "2048")  # no -load: the embedded default


@pytest.fixture
def qa(server) -> tuple[list[dict[str, str]], str]:
    return question_and_answer()


def test_openai_sdk_answers(server, qa):
    question, answer = qa
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        [model] = client.models.list().data
        assert model.id == "smollm2-135m-instruct" and "smol" in model.model_extra["jitllm"]["aliases"]
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, max_tokens=32, temperature=0)
        assert r.choices[0].message.content == answer and r.choices[0].finish_reason == "stop"
        figures = r.model_extra["jitllm"]
        assert figures["host_blocks"] == 32 and figures["decode_tokens_per_second"] > 0
        streamed = client.chat.completions.create(model=model.id, messages=question, max_tokens=32, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed) == answer


def test_anthropic_sdk_answers(server, qa):
    question, answer = qa
    with anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0) as client:
        msg = client.messages.create(model="smollm2-135m-instruct", max_tokens=32, messages=question, extra_body={"temperature": 0})
        assert msg.content[0].text == answer and msg.stop_reason == "end_turn"
        with client.messages.stream(model="smollm2-135m-instruct", max_tokens=32, messages=question, extra_body={"temperature": 0}) as stream:
            assert "".join(stream.text_stream) == answer


def test_unloading_frees_the_model(tmp_path, smollm2_jlm, tiny_serve_jlm):
    """Load and unload SmolLM2 (540 MB f32) three times, once mid-stream: the server's memory does not grow."""
    import os

    import httpx

    from jitllmd.gen.jitllm.v1 import model_pb2 as mdl
    from jitllmd.gen.jitllm.v1 import telemetry_pb2 as tel
    from jitllmd.gen.jitllm.v1.model_connect import ModelServiceClientSync
    from jitllmd.gen.jitllm.v1.telemetry_connect import TelemetryServiceClientSync

    os.link(smollm2_jlm, tmp_path / "smol.jlm")
    (tmp_path / "tiny.jlm").write_bytes(tiny_serve_jlm.read_bytes())
    s = Server("-models", str(tmp_path), "-load", "tiny.jlm", "-id", "tiny")  # a process of its own: its RSS is the subject
    try:
        with ModelServiceClientSync(s.url, send_compression=None) as models, TelemetryServiceClientSync(s.url, send_compression=None) as telemetry:
            rss = lambda: telemetry.get_stats(tel.GetStatsRequest()).rss_bytes / 2**20
            after = []
            for _ in range(3):
                models.load_model(mdl.LoadModelRequest(file="smol.jlm", id="smol"))
                loaded = rss()
                body = {"model": "smol", "prompt": "Once upon a time", "stream": True, "ignore_eos": True}
                with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
                    lines = r.iter_lines()
                    next(lines)
                    models.unload_model(mdl.UnloadModelRequest(model="smol"))
                    assert '"finish_reason":"cancelled"' in "".join(lines)
                after.append(_fallen_below(rss, loaded - 200))  # most of the 540 MB went back
            # nothing accumulates: the first two cycles settle the allocator's arenas (measured: +200 MB once), then flat
            assert after[2] < after[1] + 64, after
            assert telemetry.get_stats(tel.GetStatsRequest()).sessions == 0
    finally:
        s.stop()


def test_tools_to_a_model_without_a_tool_template(server, qa):
    question, answer = qa
    """SmolLM2's template has no tools: they are not rendered, the model answers in text, and nothing breaks."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
        plain = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, max_tokens=32, temperature=0)
        r = client.chat.completions.create(model="smollm2-135m-instruct", messages=question, tools=tools, max_tokens=32, temperature=0)
    assert r.choices[0].message.content == answer and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens  # the template left the tools out
