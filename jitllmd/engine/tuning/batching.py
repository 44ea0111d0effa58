"""The step limits a device model gets at load: rows per step and the prompt chunk, decided from counts, never timed.

`-max-batch 0` is the widest step the device runs: one row per session a device block reserves KV for (`-sessions`).
`-prompt-chunk 0` is one device prefill chunk: a count per device kind, cut to the session's room. Nothing here is
measured, so the same model on the same machine gets the same limits at every load, however busy the machine is; a
device where a joint step loses to the rows one after another is left to `-joint-steps auto` (engine/runner.py).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PREFILL_CHUNK", "Batching", "decide"]

# Prompt tokens one step feeds where -prompt-chunk is 0, by device kind. On a CPU a quantized prompt's product
# dequantizes each weight panel once a step, so a wide chunk shares that cost (llama.cpp's micro-batch is 512 too);
# an accelerator's GEMMs stay efficient wider still.
PREFILL_CHUNK = {"cpu": 512}
_ACCELERATOR_CHUNK = 2048


@dataclass(frozen=True)
class Batching:
    """What a device model's step loop runs with, and why (the start line and `stats` say both)."""

    max_rows: int
    rows_why: str
    prompt_chunk: int
    chunk_why: str

    def describe(self) -> str:
        return f"{self.max_rows} rows per step ({self.rows_why}), prompt chunk {self.prompt_chunk} tokens ({self.chunk_why})"


def decide(*, max_batch: int, sessions: int, prompt_chunk: int, device_kind: str, max_seq: int) -> Batching:
    """The flags' rows and chunk, where 0 asks for the device's own: rows = `sessions`, chunk = PREFILL_CHUNK's
    (cut to `max_seq`, the session room). A non-zero flag is kept as given (the catalog caps -max-batch at -sessions)."""
    if max_batch < 0 or prompt_chunk < 0 or sessions < 1:
        raise ValueError(f"max_batch {max_batch}, prompt_chunk {prompt_chunk}, sessions {sessions}: counts must be >= 0 (sessions >= 1)")
    if max_batch == 0:
        rows, rows_why = sessions, f"-max-batch 0: one per session, -sessions {sessions}"
    else:
        rows, rows_why = max_batch, f"-max-batch {max_batch}"
    if prompt_chunk == 0:
        wanted = PREFILL_CHUNK.get(device_kind, _ACCELERATOR_CHUNK)
        chunk = max(1, min(wanted, max_seq))
        chunk_why = f"-prompt-chunk 0: one {device_kind} prefill chunk" + (f", cut to the session room {max_seq}" if chunk < wanted else "")
    else:
        chunk, chunk_why = prompt_chunk, f"-prompt-chunk {prompt_chunk}"
    return Batching(rows, rows_why, chunk, chunk_why)
