"""CURVE key pairs on disk, in ZeroMQ's certificate format (``NAME.key`` public, ``NAME.key_secret`` secret).

``generate(out)`` lays out a whole deployment (docs/security.md)::

    OUT/broker.key_secret       the broker's pair: stays on the broker host
    OUT/broker.key              its public key: every rank and worker checks the broker against it
    OUT/rank.key_secret         a rank pair, for training ranks and `draftfeed status`
    OUT/ranks/rank.key          the broker's rank allow-list (--rank-keys OUT/ranks)
    OUT/worker.key_secret       a worker pair, for workers
    OUT/workers/worker.key      the broker's worker allow-list (--worker-keys OUT/workers)

An allow-list is a folder of public keys; a role's folder holds no other role's keys, which is what keeps
a rank key from registering as a worker.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from draftfeed.schemas.errors import UsageError


class KeyFileError(UsageError):
    """A key file or allow-list that cannot be used, with what to do about it."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes
    path: Path


def generate_pair(folder: Path, name: str, allow_list: Path | None = None) -> KeyPair:
    """A new pair ``folder/name.key(_secret)``, the secret readable by its owner only; with ``allow_list``,
    the public key is also copied there."""
    folder.mkdir(parents=True, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if (folder / f"{name}{suffix}").exists():
            raise KeyFileError(f"{folder / (name + suffix)} exists; remove it or choose another --name (keys are never overwritten)")
    public_path, secret_path = zmq.auth.create_certificates(folder, name)
    os.chmod(secret_path, 0o600)
    if allow_list is not None:
        allow_list.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(public_path, allow_list / Path(public_path).name)
    return load_pair(Path(secret_path))


def generate(out: Path) -> dict[str, KeyPair]:
    """The broker's pair and one rank and one worker pair, each public key in its role's allow-list."""
    return {
        "broker": generate_pair(out, "broker"),
        "rank": generate_pair(out, "rank", out / "ranks"),
        "worker": generate_pair(out, "worker", out / "workers"),
    }


def load_pair(path: str | Path) -> KeyPair:
    """A pair from its ``.key_secret`` file."""
    path = Path(path)
    public, secret = _load(path)
    if secret is None:
        raise KeyFileError(f"{path} holds only a public key; pass the matching .key_secret file (from `draftfeed keys generate`)")
    return KeyPair(public, secret, path)


def load_public(path: str | Path) -> bytes:
    """A public key from a ``.key`` file (a ``.key_secret`` file also holds it)."""
    return _load(Path(path))[0]


def load_allow_list(folder: str | Path, role: str) -> set[bytes]:
    """The public keys in ``folder`` (every ``*.key``); refuses an empty or missing folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KeyFileError(
            f"the {role} allow-list {folder} is not a folder; pass the folder of {role} public keys (`draftfeed keys generate` makes {role}s/)"
        )
    keys = set(zmq.auth.load_certificates(folder))
    if not keys:
        raise KeyFileError(f"the {role} allow-list {folder} holds no *.key files: no {role} could connect")
    return keys


def _load(path: Path) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise KeyFileError(f"no key file at {path}; create keys with `draftfeed keys generate --out DIR`")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise KeyFileError(f"{path} is not a ZeroMQ certificate: {exc}") from None
    if public is None or len(public) != 40:
        raise KeyFileError(f"{path} has no 40-character public key; it is not a ZeroMQ CURVE certificate")
    return public, secret
