"""The codec against memcpy: packing and unpacking an EAGLE-3 dict, beside a one-blob copy of the same bytes; and the
worker's finite check of the dict (contract/finite.py) and its XXH3 digests (dataplane/digests.py, --checksum) against a
copy of the same bytes."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from draftfeed.bench.harness import MB, Row, best_of
from draftfeed.bench.synthetic import DRAFT_VOCAB, HIDDEN
from draftfeed.contract.finite import first_nonfinite
from draftfeed.dataplane.digests import digests
from draftfeed.dataplane.frames.codec import DTYPES, decode_tensors, encode_tensors, pack_tensors, tensor_bytes
from draftfeed.schemas.messages import Result


def eagle3_dict(tokens: int) -> dict[str, torch.Tensor]:
    return {
        "aux_hidden_states": torch.randn(1, tokens, 3 * HIDDEN).to(torch.bfloat16),
        "target_probs": torch.rand(1, tokens, DRAFT_VOCAB),
        "position_mask": torch.ones(1, tokens, 1, dtype=torch.bool),
        "input_ids": torch.zeros(1, tokens, dtype=torch.int64),
        "loss_mask": torch.ones(1, tokens, dtype=torch.int64),
    }


def run(quick: bool, workdir: Path) -> list[Row]:
    tokens = 512 if quick else 2048
    tensors = eagle3_dict(tokens)
    nbytes = tensor_bytes(tensors)
    flat = [t.reshape(-1).view(torch.uint8) for t in tensors.values()]
    target = torch.empty(nbytes, dtype=torch.uint8)
    target.fill_(0)  # prefaulted: memcpy at its best

    def memcpy() -> float:
        started = time.perf_counter()
        offset = 0
        for part in flat:
            target[offset : offset + part.numel()].copy_(part)
            offset += part.numel()
        return time.perf_counter() - started

    def encode() -> float:
        started = time.perf_counter()
        pack_tensors(Result, tensors, request_id=0, kind="eagle3", worker="w")
        return time.perf_counter() - started

    def blob_encode() -> float:
        started = time.perf_counter()
        blob = bytearray(nbytes)
        offset = 0
        for part in flat:
            blob[offset : offset + part.numel()] = part.numpy().data
            offset += part.numel()
        bytes(blob)
        return time.perf_counter() - started

    specs, buffers = encode_tensors(tensors)
    frames = [bytearray(b) for b in buffers]  # writable, as received zmq frames are

    def decode() -> float:
        started = time.perf_counter()
        decode_tensors(specs, frames)
        return time.perf_counter() - started

    blob = bytes(target.numpy())

    def blob_decode() -> float:
        started = time.perf_counter()
        raw = torch.frombuffer(bytearray(blob), dtype=torch.uint8)  # bytes are read-only: one copy
        offset = 0
        for spec in specs:
            size = spec.numel() * DTYPES[spec.dtype].itemsize
            raw[offset : offset + size].clone()
            offset += size
        return time.perf_counter() - started

    def finite_check() -> float:
        started = time.perf_counter()
        assert first_nonfinite(tensors) is None
        return time.perf_counter() - started

    def digest() -> float:
        started = time.perf_counter()
        digests(tensors)
        return time.perf_counter() - started

    repeat = 3 if quick else 5
    t_memcpy = best_of(memcpy, repeat)
    case = f"{nbytes / MB:.1f} MB EAGLE-3 dict"
    return [
        Row("codec", f"encode {case}", nbytes / best_of(encode, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy", "sends copy nothing"),
        Row("codec", f"one-blob encode {case}", nbytes / best_of(blob_encode, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy"),
        Row(
            "codec", f"decode {case}", nbytes / best_of(decode, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy", "receives copy at most once"
        ),
        Row("codec", f"one-blob decode {case}", nbytes / best_of(blob_decode, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy"),
        Row("codec", f"finite check of {case}", nbytes / best_of(finite_check, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy"),
        Row("codec", f"XXH3 digests of {case} (--checksum)", nbytes / best_of(digest, repeat) / 1e9, nbytes / t_memcpy / 1e9, "GB/s", "memcpy"),
    ]
