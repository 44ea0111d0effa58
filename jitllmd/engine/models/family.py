"""What a model family declares: its arches, how it is built, and how its config and tensors come from HF and GGUF."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    import torch

    from ..jlm import JLMFile

__all__ = ["Family", "GGUFMeta", "GGUFSource", "HFSource", "SentencePieceQuirks", "TensorFix", "config_from_dict"]

Config = dict[str, Any]  # a .jlm `config`, as stored
C = TypeVar("C")


def config_from_dict(cls: type[C], d: Config) -> C:
    """A family's config dataclass from a stored config: unknown keys dropped (mlx-lm's from_dict); a required field
    that is missing is a ValueError naming it (a damaged or crafted .jlm), as the dataclass's own checks are."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    missing = [name for name, f in known.items() if f.init and f.default is MISSING and f.default_factory is MISSING and name not in d]
    if missing:
        raise ValueError(f"config.{missing[0]}: this field is required")
    return cls(**{k: v for k, v in d.items() if k in known})
TensorFix = Callable[["torch.Tensor"], "torch.Tensor"]  # a change a tensor needs on its way into the .jlm


class GGUFMeta(Protocol):
    """What a family reads of a GGUF file to make its config (convert/gguf.py implements it)."""

    arch: str  # general.architecture: the prefix of the hyperparameter keys
    shapes: dict[str, tuple[int, ...]]  # every tensor's name -> its shape as torch sees it (rows first)

    def field(self, key: str, default: Any = ...) -> Any:
        """A metadata value; where the file has none, `default`, or KeyError(key) when no default is given."""
        ...

    def values(self, name: str) -> list[float]:
        """A (small) tensor's values, dequantized."""
        ...


@dataclass(frozen=True)
class SentencePieceQuirks:
    """Where a family's GGUF files spell a SentencePiece vocabulary unlike llama's (Gemma's files: the first two)."""

    literal_spaces: bool = False  # runs of spaces are tokens spelled with real spaces, not "▁"
    ranked_by_position: bool = False  # merges rank by file position: the scores do not follow the merge order
    always_prepends_space: bool = False  # "▁" goes before every text, even one that starts with a space (Phi-3)


@dataclass(frozen=True)
class HFSource:
    """How a Hugging Face directory (config.json, *.safetensors) describes one of the family's models.

    The hooks raise KeyError / TypeError for a missing or mistyped field and ValueError for what is not supported;
    convert/hf.py names the file."""

    model_types: dict[str, str]  # config.json model_type -> .jlm arch
    config: Callable[[dict[str, Any]], Config]  # config.json -> the .jlm config
    tensor_name: Callable[[str, Config], str | None]  # (checkpoint name, .jlm config) -> .jlm name; None: not used
    required: Callable[[Config], list[str]] | None = None  # .jlm tensor names a complete checkpoint has
    # (.jlm name, config) -> the change a tensor needs, made in f32 and kept in f32 (a norm's 1 + w stays exact)
    fix: Callable[[str, Config], TensorFix | None] | None = None


@dataclass(frozen=True)
class GGUFSource:
    """How a GGUF file describes one of the family's models. The same error contract as `HFSource`."""

    archs: dict[str, str]  # general.architecture -> .jlm arch
    config: Callable[[GGUFMeta], Config]
    tensor_name: Callable[[str], str | None]  # GGUF name -> .jlm name; None: not one of the family's (an error)
    fix: Callable[[GGUFMeta, str, Config], TensorFix | None] | None = None  # (file, .jlm name, config) -> its fix
    config_tensors: tuple[str, ...] = ()  # tensors `config` reads into the config rather than the .jlm's weights
    tokenizer: SentencePieceQuirks = SentencePieceQuirks()


@dataclass(frozen=True)
class Family:
    """One model family (one file in models/), as the registry hands it to the converters and the loader."""

    archs: tuple[str, ...]  # the .jlm arch names it runs
    # an encoder that pools (EncoderModel), not a decoder that generates (DecoderModel); its config takes pooling,
    # normalize and max_seq_length, which convert/hf.py reads from the sentence-transformers files
    embeds: bool
    config: Callable[[Config], Any]  # its config class's from_dict: ValueError naming the field
    # (config, jlm, dtype, device, on_progress) -> the model: an encoder built whole on `device`; a decoder without its
    # blocks, which the loader places (engine/memory/placement.py)
    build: Callable[[Config, JLMFile, torch.dtype, torch.device, Callable[[int, int], None] | None], Any]
    hf: HFSource | None = None
    gguf: GGUFSource | None = None

    def __post_init__(self) -> None:
        if not self.archs:
            raise ValueError("Family.archs must name at least one arch")
        mapped = {*(self.hf.model_types.values() if self.hf else ()), *(self.gguf.archs.values() if self.gguf else ())}
        if unknown := sorted(mapped - set(self.archs)):
            raise ValueError(f"Family: sources map to {', '.join(unknown)}, not one of its archs ({', '.join(self.archs)})")
