"""CURVE on draftfeed's sockets: who holds which keys, and pyzmq's ZAP authenticator as the gate.

Servers (the broker's two ROUTERs, each rank's data ROUTER) hold their own pair and admit a client only if
its public key is on the allow-list of the socket's ZAP domain. Clients (ranks and workers towards the
broker, workers towards a rank's data socket) hold their own pair and the server's public key, so they
talk to nobody else. The handshake, encryption and the ZAP exchange are libzmq's and pyzmq's
(``zmq.auth.thread.ThreadAuthenticator``); this module only says which keys go where.

ZAP domains: ``draftfeed-ranks`` (broker frontend: rank keys), ``draftfeed-workers`` (broker backend:
worker keys), ``draftfeed-data`` (a rank's data socket: the keys of the workers the broker has registered
for the rank's service, which the broker sends the rank), ``draftfeed-weights`` (a ``publish_weights`` socket: the
keys of the workers the broker told to pull from it, which the broker sends the publisher).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from draftfeed.logs import RateLimitedLog
from draftfeed.security.keys import KeyFileError, KeyPair, load_allow_list, load_pair, load_public

RANKS = "draftfeed-ranks"
WORKERS = "draftfeed-workers"
DATA = "draftfeed-data"
WEIGHTS = "draftfeed-weights"
KEYS_ENV = "DRAFTFEED_KEYS"  # a folder laid out by `draftfeed keys generate`: the config entry for ranks

log = logging.getLogger("draftfeed.security")


@dataclass(frozen=True)
class PeerKeys:
    """A rank's or a worker's keys: its own pair and the broker's public key."""

    own: KeyPair
    broker: bytes

    @classmethod
    def from_files(cls, key: str | Path, broker_key: str | Path) -> PeerKeys:
        return cls(load_pair(key), load_public(broker_key))

    @classmethod
    def from_folder(cls, folder: str | Path, role: str) -> PeerKeys:
        """From a folder made by ``draftfeed keys generate``: ``ROLE.key_secret`` and ``broker.key``."""
        folder = Path(folder)
        return cls.from_files(folder / f"{role}.key_secret", folder / "broker.key")

    @classmethod
    def resolve(cls, keys: PeerKeys | str | Path | None, role: str) -> PeerKeys | None:
        """``keys`` as given (a PeerKeys or a key folder), else the folder named by $DRAFTFEED_KEYS, else None."""
        if isinstance(keys, PeerKeys):
            return keys
        folder = keys if keys is not None else os.environ.get(KEYS_ENV)
        return cls.from_folder(folder, role) if folder else None


@dataclass(frozen=True)
class BrokerKeys:
    """The broker's pair and its two allow-lists."""

    own: KeyPair
    ranks: frozenset[bytes]
    workers: frozenset[bytes]

    @classmethod
    def from_files(cls, key: str | Path, rank_keys: str | Path, worker_keys: str | Path) -> BrokerKeys:
        ranks, workers = load_allow_list(rank_keys, "rank"), load_allow_list(worker_keys, "worker")
        both = ranks & workers
        if both:
            raise KeyFileError(
                f"{len(both)} key(s) are on both the rank and the worker allow-list ({rank_keys}, {worker_keys}): "
                "give each role its own keys, or a rank could register as a worker"
            )
        return cls(load_pair(key), frozenset(ranks), frozenset(workers))

    @classmethod
    def from_folder(cls, folder: str | Path) -> BrokerKeys:
        folder = Path(folder)
        return cls.from_files(folder / "broker.key_secret", folder / "ranks", folder / "workers")


def make_client(sock: zmq.Socket, own: KeyPair, server: bytes) -> None:
    """Before connect: encrypt, prove ``own`` and accept only the server holding ``server``'s secret."""
    sock.curve_secretkey = own.secret
    sock.curve_publickey = own.public
    sock.curve_serverkey = server


def make_server(sock: zmq.Socket, own: KeyPair, domain: str) -> None:
    """Before bind: CURVE server with ``own``; its clients are checked against ``domain``'s allow-list."""
    sock.curve_server = True
    sock.curve_secretkey = own.secret
    sock.curve_publickey = own.public
    sock.zap_domain = domain.encode()


class RoleGate:
    """A ZAP credentials provider: admits the keys ``allowed()`` returns and logs why anything else is refused."""

    def __init__(self, role: str, allowed: Callable[[], Collection[bytes]], known: dict[str, Collection[bytes]] | None = None) -> None:
        self.role = role
        self._allowed = allowed
        self._known = known or {}  # other roles' keys, to name a confusion in the log
        self._log = RateLimitedLog(log, interval=5.0)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._allowed():
            return True
        other = next((name for name, keys in self._known.items() if key in keys), None)
        if other is not None:
            reason = f"a {other} key tried to connect as a {self.role}: refused (each role has its own allow-list)"
        else:
            reason = f"a key not on the {self.role} allow-list: refused"
        self._log.warning(f"{domain}:{key[:8]!r}", "security: %s (domain %s, key %s)", reason, domain, key.decode(errors="replace"))
        return False


def start_authenticator(context: zmq.Context, gates: dict[str, RoleGate]) -> ThreadAuthenticator:
    """pyzmq's ZAP handler for ``context``, one gate per domain; stop() it before the context is closed."""
    authenticator = ThreadAuthenticator(context, log=logging.getLogger("draftfeed.security.zap"))
    authenticator.start()
    for domain, gate in gates.items():
        authenticator.configure_curve_callback(domain, credentials_provider=gate)
    return authenticator


def peer_key(frame: zmq.Frame) -> str | None:
    """The authenticated public key (Z85) of the peer that sent ``frame`` on a CURVE socket, else None."""
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return user or None
