"""The tensor frame codec and the message envelope: round trips, zero copy, and every malformed case."""

from __future__ import annotations

import json

import pytest
import torch
import zmq

from draftfeed.dataplane.frames.codec import DTYPES, decode_tensors, encode_tensors, pack_tensors
from draftfeed.schemas.errors import MalformedMessage, ProtocolVersionMismatch
from draftfeed.schemas.frames import pack, unpack
from draftfeed.schemas.messages import DATA_INBOUND, FRONTEND_INBOUND, Result, TensorSpec
from draftfeed.schemas.protocol import MAX_HEADER_BYTES, SIGNATURE

pytestmark = pytest.mark.timeout(60)


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, dtype=dtype)


@pytest.fixture
def pair():
    context = zmq.Context()
    a, b = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
    for sock in (a, b):
        sock.setsockopt(zmq.LINGER, 0)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    yield a, b
    a.close(0)
    b.close(0)
    context.term()


def roundtrip(pair, tensors):
    a, b = pair
    a.send_multipart(pack_tensors(Result, tensors, request_id=1, kind="eagle3", worker="w"), copy=False)
    assert b.poll(10_000)
    header, frames = unpack(b.recv_multipart(copy=False), DATA_INBOUND)
    return decode_tensors(header.tensors, frames)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("shape", [(3, 5), (2, 40_000), (), (0,), (4, 0, 3)], ids=["small", "large", "scalar", "empty", "empty3d"])
def test_round_trip_every_dtype_over_tcp(pair, dtype, shape):
    tensor = sample(dtype, shape)
    out = roundtrip(pair, {"x": tensor})["x"]
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)


def test_non_contiguous_and_several_tensors(pair):
    base = torch.randn(64, 48)
    tensors = {"t": base.t(), "strided": base[::2, 1::3], "bf": torch.randn(7, 9).to(torch.bfloat16)[:, 2:], "ids": torch.arange(10)}
    out = roundtrip(pair, tensors)
    assert list(out) == list(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(out[name], tensor), name


def test_send_shares_the_tensor_memory():
    tensor = torch.randn(1024, 1024)
    specs, buffers = encode_tensors({"x": tensor})
    # The frame is the tensor's own memory: writing the tensor shows through the frame.
    tensor[0, 0] = 12345.0
    assert torch.frombuffer(buffers[0], dtype=torch.float32)[0].item() == 12345.0
    assert specs == [TensorSpec(name="x", dtype="float32", shape=[1024, 1024])]


def test_large_frames_are_viewed_in_place_small_ones_copied():
    payload = bytearray(torch.arange(1 << 16, dtype=torch.float32).numpy().tobytes())
    big = decode_tensors([TensorSpec(name="x", dtype="float32", shape=[1 << 16])], [payload])["x"]
    payload[0:4] = torch.tensor([7.0]).numpy().tobytes()
    assert big[0].item() == 7.0  # a view of the received buffer, no copy
    small_buf = bytearray(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    small = decode_tensors([TensorSpec(name="y", dtype="float32", shape=[4])], [small_buf])["y"]
    small_buf[0:4] = torch.tensor([7.0]).numpy().tobytes()
    assert small[0].item() == 0.0


def test_unsupported_dtype_is_refused_with_advice():
    with pytest.raises(ValueError, match="complex64 cannot be sent"):
        encode_tensors({"z": torch.zeros(2, dtype=torch.complex64)})


SPEC = TensorSpec(name="x", dtype="float32", shape=[2, 3])


@pytest.mark.parametrize(
    "specs, frames, match",
    [
        ([SPEC], [], "declares 1 tensors but the message carries 0"),
        ([SPEC], [b"\0" * 24, b""], "declares 1 tensors but the message carries 2"),
        ([SPEC], [b"\0" * 23], "needs 24 bytes but its frame holds 23"),
        ([TensorSpec(name="x", dtype="complex128", shape=[1])], [b"\0" * 16], "unknown dtype 'complex128'"),
        ([TensorSpec(name="x", dtype="float32", shape=[1 << 39])], [b""], "over the limit"),
        ([SPEC, SPEC], [b"\0" * 24, b"\0" * 24], "appears twice"),
        ([SPEC] * 65, [b"\0" * 24] * 65, "at most 64"),
    ],
)
def test_decode_rejects_malformed(specs, frames, match):
    with pytest.raises(MalformedMessage, match=match):
        decode_tensors(specs, frames)


def test_message_size_limit_is_checked_before_any_allocation():
    specs = [TensorSpec(name=f"t{i}", dtype="uint8", shape=[600]) for i in range(2)]
    with pytest.raises(MalformedMessage, match="over 1000 bytes"):
        decode_tensors(specs, [b"\0" * 600] * 2, max_message_bytes=1000)


@pytest.mark.parametrize(
    "frames, error, match",
    [
        ([SIGNATURE], MalformedMessage, "at least 2 frames"),
        ([b"HTTP/1.1", b"{}"], MalformedMessage, "not a draftfeed message"),
        ([b"draftfeed/0", b"{}"], ProtocolVersionMismatch, f"peer speaks draftfeed/0, this process speaks {SIGNATURE.decode()}"),
        ([SIGNATURE, b"{not json"], MalformedMessage, "invalid header"),
        ([SIGNATURE, json.dumps({"type": "launch_missiles"}).encode()], MalformedMessage, "invalid header"),
        ([SIGNATURE, json.dumps({"type": "submit", "request_id": -1, "kind": "eagle3"}).encode()], MalformedMessage, "request_id"),
        ([SIGNATURE, json.dumps({"type": "submit", "request_id": 1, "kind": "eagle3", "extra": 1}).encode()], MalformedMessage, "extra"),
        ([SIGNATURE, b" " * (MAX_HEADER_BYTES + 1)], MalformedMessage, "over the limit"),
    ],
)
def test_unpack_rejects_malformed(frames, error, match):
    with pytest.raises(error, match=match):
        unpack(frames, FRONTEND_INBOUND)


def test_pack_layout_is_signature_header_tensors():
    frames = pack_tensors(Result, {"a": torch.zeros(2), "b": torch.ones(3, dtype=torch.int64)}, request_id=5, kind="eagle3", worker="w")
    assert len(frames) == 4
    assert frames[0] == SIGNATURE
    header = json.loads(frames[1])
    assert header["type"] == "result" and header["request_id"] == 5
    assert [t["name"] for t in header["tensors"]] == ["a", "b"]
    assert [memoryview(f).nbytes for f in frames[2:]] == [8, 24]
    assert pack(Result(request_id=1, kind="eagle3", worker="w", tensors=[]))[2:] == []


def test_the_torch_free_item_sizes_are_torchs():
    from draftfeed.schemas.tensor_specs import ITEMSIZES

    assert set(ITEMSIZES) == set(DTYPES)
    assert {name: DTYPES[name].itemsize for name in ITEMSIZES} == ITEMSIZES
