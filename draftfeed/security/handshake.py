"""Why a connection to the broker does not come up, in words: from the ZeroMQ handshake events of the client socket.

A secure broker never answers a peer whose handshake it refused, so without this a wrong key looks like a broker
that is not there. libzmq tells the client, though: a mechanism mismatch (one side CURVE, the other plaintext), an
authentication refusal (status 400: the key is not on the broker's allow-list for that port), or a failed handshake
without detail (the server closed it: a CURVE client that holds another broker's public key, or a plaintext client
at a secure broker that closed before the mismatch was told). ``HandshakeWatch`` reads those events until a
handshake succeeds; a mismatch or a refusal is a verdict at once, a failure without detail when it repeats.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import recv_monitor_message

_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_ALLOW_LIST = {"rank": "--rank-keys", "worker": "--worker-keys"}
_OTHER_ROLE = {"rank": "worker", "worker": "rank"}
REPEATS = 3  # failures without detail before they are the verdict (one can be a connection lost in passing)


class HandshakeWatch:
    """Watch ``sock`` (a client of the broker at ``endpoint``, before it connects) for its handshakes.

    ``role`` is "rank" or "worker"; ``secure`` whether the socket holds CURVE keys. Poll ``monitor`` for input and
    call ``read()``; ``verdict`` is then why the last handshake failed (None while none failed), ``succeeded``
    whether one succeeded. ``close()`` when done watching."""

    def __init__(self, sock: zmq.Socket, endpoint: str, role: str, secure: bool) -> None:
        self.endpoint, self.role, self.secure = endpoint, role, secure
        self._sock = sock
        self.monitor: zmq.Socket = sock.get_monitor_socket(_EVENTS)
        self.verdict: str | None = None
        self.succeeded = False
        self._without_detail = 0

    def read(self) -> None:
        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.succeeded, self.verdict, self._without_detail = True, None, 0
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                self._without_detail += 1
                if self._without_detail >= REPEATS:
                    self.verdict = self._explain(kind, value)
            else:
                self.verdict = self._explain(kind, value)

    def _explain(self, kind: int, value: int) -> str:
        where = f"the broker at {self.endpoint}"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.secure:
                return f"this {self.role} has CURVE keys but {where} is not secure: start the broker with --secure, or connect without keys"
            keys = "keys= (or set DRAFTFEED_KEYS=DIR)" if self.role == "rank" else "--secure --keys DIR"
            return f"{where} is secure (CURVE) and this {self.role} has no keys: pass {keys}, from `draftfeed keys generate`"
        if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (
                f"{where} refused this {self.role}'s key (status {value}): it is not on the broker's {_ALLOW_LIST[self.role]} allow-list "
                f"for this port (a {_OTHER_ROLE[self.role]}'s key is refused here too)"
            )
        if self.secure:
            return (
                f"the CURVE handshake with {where} failed: check that the broker.key this {self.role} uses is that broker's public "
                "key, and that the broker runs with --secure"
            )
        keys = "keys= (or set DRAFTFEED_KEYS=DIR)" if self.role == "rank" else "--secure --keys DIR"
        return f"{where} closes this {self.role}'s plaintext handshake: it is most likely secure (CURVE); pass {keys}, from `draftfeed keys generate`"

    def close(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.monitor.close(linger=0)
