"""Theta: a model's weights, a flat mapping of dotted names to plain or sharded tensors.

Names are the model's: the Llama loaders of ``sharktank.models`` give the Hugging Face
layout (``model.layers.0.self_attn.q_proj.weight``) whatever file the weights came from.
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping

import torch

from ..types import QuantizedTensor, ShardedTensor, stored

__all__ = ["Theta"]

AnyTensor = torch.Tensor | ShardedTensor | QuantizedTensor


class Theta(Mapping[str, AnyTensor]):
    """An immutable mapping of names to tensors, with sub-tree views by prefix."""

    __slots__ = ("_tensors",)

    def __init__(self, tensors: Mapping[str, AnyTensor]):
        for name, t in tensors.items():
            if not isinstance(t, (torch.Tensor, ShardedTensor, QuantizedTensor)):
                raise TypeError(f"Theta entry {name!r} must be a tensor, found {type(t).__name__}")
        self._tensors = dict(tensors)

    def __getitem__(self, name: str) -> AnyTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in theta ({len(self)} tensors)") from None

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __repr__(self) -> str:
        return f"Theta({len(self)} tensors)"

    def subtree(self, prefix: str) -> "Theta":
        """The entries under ``prefix.`` with the prefix removed."""
        p = prefix + "."
        return Theta({k[len(p) :]: v for k, v in self._tensors.items() if k.startswith(p)})

    def map(self, fn: Callable[[str, AnyTensor], AnyTensor]) -> "Theta":
        """A new theta with ``fn(name, tensor)`` applied to every entry."""
        return Theta({k: fn(k, v) for k, v in self._tensors.items()})

    def nbytes(self) -> int:
        total = 0
        for t in self._tensors.values():
            for s in t.shards if isinstance(t, ShardedTensor) else (t,):
                total += stored(s).numel() * stored(s).element_size()
        return total
