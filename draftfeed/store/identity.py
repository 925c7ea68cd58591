"""What a store holds, and the key of each batch in it.

A store holds the supervision of one target, computed with one vocab mapping and sent in the forms of one
service: its ``StoreIdentity``. A batch's key is a digest of that identity and of every tensor the rank sent
for the batch (input ids, masks, the packing arguments of a packed batch and the image inputs of an image-text
batch), so that two batches have one
key only when a worker would compute the same supervision for both.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from pydantic import BaseModel, ConfigDict, Field

from draftfeed.dataplane.frames.codec import dtype_name
from draftfeed.schemas.messages import LogitTransform, MappingDigest, SupervisionForm, TargetInfo, TaskName

STORE_FORMAT = 1  # the on-disk layout's version; a store of another version is refused at open


class StoreIdentity(BaseModel):
    """The target, mapping and forms a store's batches were computed with; written once, in store.json."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    format: int = STORE_FORMAT
    task: TaskName
    target: TargetInfo = Field(discriminator="task")
    forms: list[SupervisionForm]  # the forms the service's workers sent (DSpark, and DFlash without logits, have one)
    logit_transform: LogitTransform | None = None  # how the rank rebuilds probabilities from the compact form
    mapping_digest: MappingDigest | None = None  # the vocab mapping's digest; None: the identity mapping

    def digest(self) -> str:
        """blake2b-128 of the canonical JSON, in hex: part of every batch key."""
        return hashlib.blake2b(self.model_dump_json().encode(), digest_size=16).hexdigest()

    def describe_mismatch(self, other: StoreIdentity, mine: str, theirs: str) -> str:
        """'' when equal; otherwise each field that differs with both values ('; '-separated)."""
        problems = []
        for name in type(self).model_fields:
            a, b = getattr(self, name), getattr(other, name)
            if a == b:
                continue
            if name == "target" and type(a) is type(b):
                problems.append(f"target {a.describe_mismatch(b, mine, theirs)}")
            else:
                problems.append(f"{name}: {mine} {_shown(a)}, {theirs} {_shown(b)}")
        return "; ".join(problems)


def _shown(value: object) -> str:
    return repr(value.model_dump() if isinstance(value, BaseModel) else value)


def batch_key(identity_digest: str, tensors: Mapping[str, torch.Tensor]) -> str:
    """The key of the batch whose request holds ``tensors``: blake2b-128 over the identity and, by name, each
    tensor's dtype, shape and bytes (on the CPU), in hex."""
    digest = hashlib.blake2b(identity_digest.encode(), digest_size=16)
    for name in sorted(tensors):
        tensor = tensors[name].detach().to("cpu").contiguous()
        digest.update(f"|{name}:{dtype_name(tensor.dtype)}:{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
