"""The `jitllm` figures of a response: where its model ran, how long it waited and took, and the bytes per token."""

from __future__ import annotations

from typing import Any

from .loader import LoadedModel
from .request import Request

__all__ = ["decode_bytes", "request_figures", "where"]


def where(loaded: LoadedModel) -> dict[str, Any]:
    """Its blocks on devices or the host now, and which devices."""
    placement = loaded.placement
    if placement is None:  # an encoder: whole on its device, or the host
        device_blocks = loaded.num_blocks if loaded.device_ids else 0
    else:
        device_blocks = placement.num_device_blocks
    return {"device_blocks": device_blocks, "host_blocks": loaded.num_blocks - device_blocks, "device_ids": list(loaded.device_ids)}


def decode_bytes(loaded: LoadedModel) -> int:
    """Bytes a decode step reads besides KV: the weights, wherever they are, and the hidden state over each seam."""
    placement = loaded.placement
    if placement is None:
        return loaded.weight_nbytes()
    width = int(loaded.model.cfg.hidden_size) * 4  # the f32 residual stream crosses each seam
    return loaded.weight_nbytes() + placement.num_seams * width


def request_figures(req: Request, loaded: LoadedModel) -> dict[str, Any]:
    """The figures of a finished generation."""
    ms = lambda a, b: round((b - a) * 1000, 3) if a is not None and b is not None else 0.0
    decode_s = (req.t_last_token - req.t_first_token) if req.t_first_token and req.t_last_token else 0.0
    generated_after_first = max(0, len(req.output_ids) - 1)
    return {
        "session_id": req.session.id,
        "queued_ms": ms(req.t_arrival, req.t_first_step),
        "queue_depth_on_entry": req.queue_depth_on_entry,
        **where(loaded),
        "prefill_ms": ms(req.t_first_step, req.t_first_token),
        "decode_ms": round(decode_s * 1000, 3),
        "decode_tokens_per_second": round(generated_after_first / decode_s, 2) if decode_s > 0 else 0.0,
        "bytes_per_token": int(req.decode_bytes / req.decode_steps) if req.decode_steps else 0,
    }
