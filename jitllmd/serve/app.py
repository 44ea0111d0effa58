"""The route table: every path the server answers, in one place."""

from __future__ import annotations

from connectrpc.server import ConnectASGIApplication
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route

from ..engine.catalog import Catalog
from ..gen.jitllm.v1.device_connect import DeviceServiceASGIApplication
from ..gen.jitllm.v1.inference_connect import InferenceServiceASGIApplication
from ..gen.jitllm.v1.model_connect import ModelServiceASGIApplication
from ..gen.jitllm.v1.placement_connect import PlacementServiceASGIApplication
from ..gen.jitllm.v1.session_connect import SessionServiceASGIApplication
from ..gen.jitllm.v1.telemetry_connect import TelemetryServiceASGIApplication
from . import anthropic, openai, rendering
from .body import APIError
from .embeddings import Embeddings
from .guard import Guard
from .metrics import Metrics
from .openai_request import Limits
from .rerank import Scoring
from .response_store import ResponseStore, StoreLimits
from .responses import Responses
from .services.control import Devices, ErrorMapper, Models, Sessions
from .services.inference import Inference
from .services.placement import Placement
from .services.telemetry import ServerInfo, Telemetry
from .tokenize import Tokenizing

__all__ = ["Health", "build_app"]


class Health:
    """What GET /healthz says: `ok`, or while the server still loads the models it was started with, a 503 that says
    what it is doing (as llama-server's 503 while loading), so a probe waits for a server that can answer."""

    def __init__(self, loading: str | None = None):
        self.loading = loading  # e.g. "loading smol.jlm"; None once every start-up model is served

    async def endpoint(self, request: Request) -> Response:
        loading = self.loading
        return PlainTextResponse("ok") if loading is None else PlainTextResponse(f"{loading}\n", status_code=503)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Unknown paths and wrong methods, in the error shape of the dialect the path belongs to."""
    assert isinstance(exc, HTTPException)
    kind = "not_found" if exc.status_code == 404 else "invalid_request"
    message = f"{request.method} {request.url.path}: " + ("no such route" if exc.status_code == 404 else str(exc.detail))
    err = APIError(message, kind=kind)
    resp = anthropic.error_response(err) if request.url.path.startswith("/v1/messages") else rendering.error_response(err)
    resp.status_code = exc.status_code
    if exc.headers:
        resp.headers.update(exc.headers)
    return resp


def build_app(catalog: Catalog, info: ServerInfo, *, api_key: str | None = None, allowed_hosts: frozenset[str] | None = None,
              health: Health | None = None, limits: Limits | None = None, stored: StoreLimits | None = None) -> Starlette:
    """Every route behind the Guard (jitllmd/serve/guard.py): api_key, when given, is asked of all but /healthz;
    allowed_hosts, when given, are the only names a Host header may carry besides IP addresses. `health`: what
    /healthz says (default: always ok). `limits`: what one OpenAI request may fan out to; `stored`: the bounds (and
    directory) of the responses /v1/responses keeps."""
    oa, an, metrics, tok = openai.OpenAI(catalog, limits), anthropic.Anthropic(catalog), Metrics(catalog), Tokenizing(catalog)
    scoring, responses = Scoring(catalog), Responses(catalog, ResponseStore(stored or StoreLimits()), limits)
    routes: list[BaseRoute] = [
        Route("/healthz", (health or Health()).endpoint, methods=["GET"]),
        Route("/metrics", metrics.endpoint, methods=["GET"]),
        Route("/v1/chat/completions", oa.chat_completions, methods=["POST"]),
        Route("/v1/completions", oa.completions, methods=["POST"]),
        Route("/v1/embeddings", Embeddings(catalog).endpoint, methods=["POST"]),
        Route("/v1/models", oa.models, methods=["GET"]),
        Route("/v1/models/{model:path}", oa.model, methods=["GET"]),
        Route("/v1/responses", responses.create, methods=["POST"]),  # OpenAI's Responses API (serve/responses.py)
        Route("/v1/responses/input_tokens", responses.input_tokens, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
        Route("/v1/messages", an.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", an.count_tokens, methods=["POST"]),
        Route("/tokenize", tok.tokenize, methods=["POST"]),  # llama-server's and vLLM's shapes (serve/tokenize.py)
        Route("/detokenize", tok.detokenize, methods=["POST"]),
        Route("/tokenizer_info", tok.tokenizer_info, methods=["GET"]),  # vLLM's: lm-eval's remote tokenizer reads it
        Route("/v1/rerank", scoring.rerank, methods=["POST"]),  # Jina's and Cohere's shape (serve/rerank.py), at each path vLLM serves it
        Route("/rerank", scoring.rerank, methods=["POST"]),
        Route("/v2/rerank", scoring.rerank, methods=["POST"]),
        Route("/v1/score", scoring.score, methods=["POST"]),  # vLLM's
        Route("/score", scoring.score, methods=["POST"]),
    ]
    interceptors = [ErrorMapper(catalog)]
    services: list[ConnectASGIApplication] = [  # the Connect control plane: /jitllm.v1.<Service>/<Method>, over Connect, gRPC and gRPC-Web
        ModelServiceASGIApplication(Models(catalog), interceptors=interceptors),
        DeviceServiceASGIApplication(Devices(catalog), interceptors=interceptors),
        SessionServiceASGIApplication(Sessions(catalog), interceptors=interceptors),
        PlacementServiceASGIApplication(Placement(catalog), interceptors=interceptors),
        InferenceServiceASGIApplication(Inference(catalog), interceptors=interceptors),
        TelemetryServiceASGIApplication(Telemetry(catalog, info), interceptors=interceptors),
    ]
    routes += [Mount(app.path, app=app) for app in services]
    guard = Middleware(Guard, api_key=api_key, allowed_hosts=allowed_hosts, observe=metrics.observe_request)
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error}, middleware=[guard])
