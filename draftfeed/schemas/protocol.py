"""Wire-protocol constants: the signature frame, its version, defaults and size limits.

Every draftfeed message on every socket has the same layout (see docs/protocol.md)::

    frame 0   SIGNATURE            b"draftfeed/<version>"
    frame 1   header               UTF-8 JSON of one pydantic message model (field "type" names it)
    frame 2.. tensor payloads      one frame per tensor, in the order of header.tensors

Peers with another protocol version are rejected with an error that names both versions.
"""

from __future__ import annotations

PROTOCOL_NAME = b"draftfeed"
PROTOCOL_VERSION = 9
SIGNATURE = PROTOCOL_NAME + b"/" + str(PROTOCOL_VERSION).encode()

# Where a message's tensor frames begin, after any ROUTER identity frame has been taken off: [signature, header, *tensors].
FIRST_TENSOR_FRAME = 2

# Largest header frame a peer accepts; headers are small JSON documents.
MAX_HEADER_BYTES = 1 << 20
# Default cap on one tensor frame and on all tensor frames of one message: a 128k row of a 7168-wide target fits
# (DSpark's five layers in bfloat16: 9.4 GB in one tensor, 11.3 GB in all).
DEFAULT_MAX_TENSOR_BYTES = 16 << 30
DEFAULT_MAX_MESSAGE_BYTES = 32 << 30
# Default cap on any one frame the broker accepts (libzmq drops a peer that sends more, before allocating),
# and on the tensors of one request (settable per service).
DEFAULT_MAX_FRAME_BYTES = 256 << 20
DEFAULT_MAX_REQUEST_BYTES = 256 << 20
# Supervision over frames moves in chunks of at most a worker's --transfer-chunk-bytes (dataplane/frames/chunks.py), so
# that neither side holds a second copy of a multi-gigabyte answer. The default stays under glibc's largest mmap
# threshold (32 MiB), so the rank's allocator reuses each chunk's memory instead of mapping (and faulting) it anew;
# the largest is the most any frame on a rank's data socket may be (libzmq refuses more before allocating it).
DEFAULT_TRANSFER_CHUNK_BYTES = 16 << 20
MAX_TRANSFER_CHUNK_BYTES = 1 << 30
# Most tensors one message may carry.
MAX_TENSORS_PER_MESSAGE = 64
# What no message grows past, however large the cluster: the pairs one worker heartbeat reports (the changed ones,
# the rest in the next heartbeats), and the ranks or workers one notice names (forget_ranks, workers_gone; more go
# in more messages).
PAIRS_PER_BEAT = 16
MAX_NOTICES = 1024
# The requests one ``where`` asks about (a rank asks about its oldest first; the rest at its next beat).
MAX_WHERE = 64

DEFAULT_FRONTEND = "tcp://*:5555"
DEFAULT_BACKEND = "tcp://*:5556"
# Health and metrics over HTTP (GET /health, GET /metrics): the broker's and a worker's default ports, on every
# interface. Several workers on one machine each need a port of their own; 0 turns the endpoint off.
DEFAULT_HTTP_HOST = "0.0.0.0"
DEFAULT_BROKER_HTTP_PORT = 8555
DEFAULT_WORKER_HTTP_PORT = 8556

# Tensors smaller than this are copied out of the received frame into fresh, aligned torch memory
# (libzmq keeps very small messages inline and unaligned); larger ones are viewed in place.
INLINE_COPY_BYTES = 1 << 16
