"""What a converter reads from a source: the arch, config, tensors to write and the tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ..jlm import TensorSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["ConvertError", "Source", "block_order", "naming"]

T = TypeVar("T")


class ConvertError(ValueError):
    """A source cannot be converted: the message is one line that names the file and the reason."""


@dataclass
class Source:
    arch: str
    config: dict[str, Any]
    tensors: list[TensorSpec]
    tokenizer_json: str
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: list[int]
    add_bos_token: bool
    chat_template: str | None
    source: dict[str, Any] = field(default_factory=dict)
    special_tokens: dict[str, str] = field(default_factory=dict)  # more roles, e.g. an encoder's cls_token, sep_token
    quantization: dict[str, dict[str, Any]] = field(default_factory=dict)  # tensor -> {"type", "shape"}: stored quantized
    embeds: bool = False  # an encoder (its tensors stay float)
    notes: list[str] = field(default_factory=list)  # what the conversion changed on the way, for its summary
    # tokenizer_json as a Tokenizer: the reader's own where it built one, else parsed once when first needed (a
    # 262k-token vocabulary takes a second to parse)
    tokenizer: Tokenizer | None = field(default=None, repr=False)

    def meta(self) -> dict[str, Any]:
        """The .jlm metadata document (see docs/format.md)."""
        return {
            "arch": self.arch,
            "config": self.config,
            "tokenizer": self.tokenizer_json,
            "chat_template": self.chat_template,
            "special_tokens": {
                "bos_token": self.bos_token,
                "bos_token_id": self._token_id(self.bos_token),
                "eos_token": self.eos_token,
                "eos_token_ids": self.eos_token_ids,
                "add_bos_token": self.add_bos_token,
                **self._roles(),
            },
            "quantization": self.quantization,
            "source": self.source,
        }

    def _roles(self) -> dict[str, Any]:
        """The other special tokens as `{role: token, role_id: id}` (an encoder's cls_token, sep_token, pad_token)."""
        out: dict[str, Any] = {}
        for role, token in self.special_tokens.items():
            out[role] = token
            out[f"{role}_id"] = self._token_id(token)
        return out

    def _token_id(self, token: str | None) -> int | None:
        if token is None:
            return None
        if self.tokenizer is None:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_str(self.tokenizer_json)
        return self.tokenizer.token_to_id(token)


def block_order(spec: TensorSpec) -> tuple[int, int, str]:
    """embed, blocks in order, head (if the model has one): each block's bytes stay contiguous in the file."""
    n = spec.name
    if n.startswith("embed."):
        return (0, 0, n)
    if n.startswith("blocks."):
        return (1, int(n.split(".")[1]), n)
    return (2, 0, n)


def naming(path: Path, find: Callable[[], T]) -> T:
    """`find()`'s answer; its ValueError (e.g. an unsupported architecture) a ConvertError naming the source."""
    try:
        return find()
    except ValueError as exc:
        raise ConvertError(f"{path}: {exc}") from None
