"""Writing a capture's joined parts (base.Joined) into one tensor as an engine computes them.

The tensor is allocated at the first part written, in that part's dtype and on its device, [*leading, parts x H],
and every part goes into its own columns; a part written for some rows or positions only (an engine that runs one
request per row or document) fills those and leaves the rest zero, as the contract has padded positions.
"""

from __future__ import annotations

import torch

from draftfeed.consumers.engines.base import Joined, Part


class JoinedWriter:
    def __init__(self, joined: Joined, leading: tuple[int, ...] | None = None) -> None:
        """``leading``: the joined tensor's dimensions before the last (the whole batch's), when a part written may
        cover only some of it (rows computed one at a time); None: those of the first part written."""
        self.joined = joined
        self.leading = leading
        self.tensor: torch.Tensor | None = None

    @classmethod
    def allocated(cls, joined: Joined, leading: tuple[int, ...], width: int, dtype: torch.dtype, device: torch.device) -> JoinedWriter:
        """One whose tensor exists already, all zeros (an engine that knows the parts' width, and may write none)."""
        writer = cls(joined, leading)
        writer.tensor = torch.zeros(*leading, len(joined.parts) * width, dtype=dtype, device=device)
        return writer

    def wants(self, part: Part) -> bool:
        return part in self.joined.parts

    def write(self, part: Part, value: torch.Tensor, at: tuple = ()) -> None:
        """Put ``value`` (folded, if the joined parts are) into ``part``'s columns, at the leading index ``at`` (an
        index of the leading dimensions, e.g. ``(row, positions)``; empty: all of them)."""
        if self.joined.fold is not None:
            value = self.joined.fold(part, value)
        width = value.shape[-1]
        if self.tensor is None:
            leading = self.leading if self.leading is not None else tuple(value.shape[:-1])
            self.tensor = torch.zeros(*leading, len(self.joined.parts) * width, dtype=value.dtype, device=value.device)
        column = self.joined.parts.index(part) * width
        self.tensor[(*at, Ellipsis, slice(column, column + width))] = value
