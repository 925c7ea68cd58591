"""What ``launch broker`` and ``launch worker`` are set up by: each command's whole settings, the sides' own
(BrokerSettings, WorkerSettings) beside the command's (where the broker listens, which key files, health and
metrics). Their fields are the commands' flags, ``DRAFTFEED_*`` variables, TOML keys and ``--print-config`` lines
(draftfeed/launch/flags.py); the key files are read here, before any engine loads. No torch, no pyzmq auth."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from draftfeed.broker.settings import BrokerSettings
from draftfeed.consumers.settings import WorkerSettings
from draftfeed.schemas.errors import UsageError
from draftfeed.schemas.protocol import DEFAULT_BACKEND, DEFAULT_BROKER_HTTP_PORT, DEFAULT_FRONTEND, DEFAULT_HTTP_HOST, DEFAULT_WORKER_HTTP_PORT
from draftfeed.schemas.settings import Settings, setting

if TYPE_CHECKING:  # loaded when keys are read: pyzmq's auth is not needed for --help
    from draftfeed.security.curve import BrokerKeys, PeerKeys

SECURITY = "security (docs/security.md)"


class Listen(Settings):
    """Where the broker listens, and its name."""

    GROUP: ClassVar[str] = "where it listens"

    frontend: str = setting(DEFAULT_FRONTEND, "where training ranks connect (tcp://HOST:* picks a free port)", parse="endpoint")
    backend: str = setting(DEFAULT_BACKEND, "where workers connect", parse="endpoint")
    name: str | None = setting(None, "the broker's name in logs and status (default HOST-PID)")


class BrokerKeyFiles(Settings):
    """The broker's CURVE key and the allow-lists of rank and worker keys."""

    GROUP: ClassVar[str] = SECURITY

    secure: bool = setting(False, "CURVE on both sockets: only rank keys at the frontend, only worker keys at the backend (docs/security.md)")
    keys_folder: str | None = setting(
        None, "with --secure: a folder from `draftfeed keys generate` (broker.key_secret, ranks/, workers/)", flag="--keys"
    )
    key: str | None = setting(None, "with --secure: the broker's .key_secret file (overrides --keys)")
    rank_keys: str | None = setting(None, "with --secure: the folder of rank public keys allowed at the frontend (overrides --keys)")
    worker_keys: str | None = setting(None, "with --secure: the folder of worker public keys allowed at the backend (overrides --keys)")

    def broker_keys(self) -> BrokerKeys | None:
        """The keys of ``--secure`` (None without it); a UsageError for a file given without it, or one missing."""
        from draftfeed.security.curve import BrokerKeys

        given = [
            flag
            for flag, value in (
                ("--keys", self.keys_folder),
                ("--key", self.key),
                ("--rank-keys", self.rank_keys),
                ("--worker-keys", self.worker_keys),
            )
            if value
        ]
        if not self.secure:
            if given:
                raise UsageError(f"{', '.join(given)} given without --secure: add --secure to use them")
            return None
        folder = Path(self.keys_folder) if self.keys_folder else None
        paths = {
            "--key": self.key or (folder / "broker.key_secret" if folder else None),
            "--rank-keys": self.rank_keys or (folder / "ranks" if folder else None),
            "--worker-keys": self.worker_keys or (folder / "workers" if folder else None),
        }
        missing = [flag for flag, path in paths.items() if path is None]
        if missing:
            raise UsageError(f"--secure needs {', '.join(missing)} (or --keys DIR from `draftfeed keys generate`)")
        return BrokerKeys.from_files(paths["--key"], paths["--rank-keys"], paths["--worker-keys"])


class PeerKeyFiles(Settings):
    """The key files a rank (``draftfeed status``) or a worker connects to the broker with."""

    GROUP: ClassVar[str] = SECURITY

    keys_folder: str | None = setting(
        None,
        "a folder from `draftfeed keys generate`: use its rank.key_secret (status) or worker.key_secret (a worker) and broker.key "
        "(default: $DRAFTFEED_KEYS if set)",
        flag="--keys",
    )
    key: str | None = setting(None, "this rank's or worker's .key_secret file (overrides --keys)")
    broker_key: str | None = setting(None, "the broker's public .key file (overrides --keys)")

    def peer_keys(self, role: str, required: bool) -> PeerKeys | None:
        """The keys of ``role`` ("rank" or "worker") from the files, else $DRAFTFEED_KEYS; None when neither names
        any, unless ``required``."""
        from draftfeed.security.curve import KEYS_ENV, PeerKeys

        folder = self.keys_folder or os.environ.get(KEYS_ENV)
        if self.key or self.broker_key:
            if not (self.key and self.broker_key) and not folder:
                raise UsageError("--key and --broker-key go together (or pass --keys DIR for both)")
            return PeerKeys.from_files(self.key or Path(folder) / f"{role}.key_secret", self.broker_key or Path(folder) / "broker.key")
        if folder:
            return PeerKeys.from_folder(folder, role)
        if required:
            raise UsageError(
                f"--secure needs keys: --keys DIR (from `draftfeed keys generate`), or --key {role}.key_secret and --broker-key broker.key"
            )
        return None


class WorkerKeyFiles(PeerKeyFiles):
    """A worker's key files, used with ``--secure``."""

    secure: bool = setting(False, "CURVE to the broker and to ranks, with this worker's key (docs/security.md)")

    def worker_keys(self) -> PeerKeys | None:
        """The worker's keys with ``--secure`` (None without it); a UsageError for key files given without it."""
        if not self.secure:
            if self.keys_folder or self.key or self.broker_key:
                raise UsageError("--keys/--key/--broker-key given without --secure: add --secure to use them")
            return None
        return self.peer_keys("worker", required=True)


class Http(Settings):
    """Health and metrics over HTTP."""

    GROUP: ClassVar[str] = "health and metrics"

    http_port: int | None = setting(
        None,
        f"serve GET /health and GET /metrics (Prometheus) on this port (default {DEFAULT_BROKER_HTTP_PORT} for the broker, "
        f"{DEFAULT_WORKER_HTTP_PORT} for a worker; taken by another process, the default is skipped with a warning, a port given here is "
        "an error); 0 turns it off",
    )
    http_host: str = setting(DEFAULT_HTTP_HOST, "the address /health and /metrics listen on")


class BrokerCommand(Settings):
    """Everything ``draftfeed launch broker`` is set up by."""

    listen: Listen = Listen()
    broker: BrokerSettings = BrokerSettings()
    security: BrokerKeyFiles = BrokerKeyFiles()
    http: Http = Http()


class WorkerCommand(Settings):
    """Everything ``draftfeed launch worker`` is set up by."""

    worker: WorkerSettings
    security: WorkerKeyFiles = WorkerKeyFiles()
    http: Http = Http()
