"""One NIXL agent: registered memory, remote agents, one-sided writes with a notification, one-sided reads. The
transport alone.

NIXL (https://github.com/ai-dynamo/nixl) moves bytes between registered memory of two agents over its UCX
backend: RDMA on InfiniBand or RoCE, GPUDirect for CUDA memory, shared memory or TCP where that is all
there is. The package is optional (``pip install draftfeed[nixl]``, module ``nixl_cu12``); ``unavailable()``
says why it cannot be used here. Agent metadata is opaque bytes each side sends on draftfeed's own sockets;
descriptors travel as plain ``(address, bytes, device)`` numbers in our JSON, never NIXL's serialised form.

The owners of the protocol (the worker's dataplane/nixl/worker.py and worker_writes.py, the rank's
dataplane/nixl/rank.py and rank_slots.py) decide what to write where and when memory may be reused; this module
only wraps the calls and turns NIXL's failures into ``NixlError``. The memory it moves is described in memory.py.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from draftfeed.dataplane.nixl.memory import Region

# Microseconds NIXL's progress thread rests between rounds. Its Python wrapper sets 0, a busy loop that takes a
# quarter of a core from every idle process that has an agent; 100 us costs under 2% while idle. During a run of
# 16 MB writes it took about a third of a core in the worker, and 1000 us lowered the rate (docs/performance.md).
PROGRESS_THREAD_DELAY_US = 100

_import_lock = threading.Lock()
_api: Any = None
_import_error: str | None = None


class _Binding:
    """NIXL's binding module as its Python wrapper sees it while an agent is made, with the progress thread's
    delay set on the agent's config (the wrapper offers no setting for it)."""

    def __init__(self, binding: Any) -> None:
        self._binding = binding

    def __getattr__(self, name: str) -> Any:
        return getattr(self._binding, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = PROGRESS_THREAD_DELAY_US
        return self._binding.nixlAgent(name, config)


class NixlError(RuntimeError):
    """A NIXL call failed (no backend, a remote agent that cannot be reached, a transfer in error)."""


def _load() -> Any:
    global _api, _import_error
    with _import_lock:
        if _api is None and _import_error is None:
            try:
                from nixl_cu12 import _api as api  # the cu12 wheel; its Python API is the same on cu13
            except Exception as exc:  # ImportError, or a library that fails to load
                _import_error = f"{type(exc).__name__}: {exc}"
            else:
                _api = api
                logging.getLogger("nixl").setLevel(logging.WARNING)  # NIXL logs every agent and backend at INFO
    if _api is None:
        raise NixlError(f"NIXL is not installed here ({_import_error}): pip install 'draftfeed[nixl]'")
    return _api


def unavailable() -> str | None:
    """Why NIXL cannot be used in this process, or None when it can."""
    try:
        _load()
    except NixlError as exc:
        return str(exc)
    return None


class Transfer:
    """One posted write or read: poll it until it is done; release it exactly once."""

    def __init__(self, agent: NixlAgent, handle: Any, state: str) -> None:
        self._agent, self._handle, self.state = agent, handle, state

    def poll(self) -> str:
        """``DONE``, ``PROC`` (still moving) or ``ERR``."""
        if self.state == "PROC":
            try:
                self.state = self._agent._agent.check_xfer_state(self._handle)
            except Exception as exc:
                self.state = "ERR"
                raise NixlError(f"checking a NIXL transfer failed: {exc}") from exc
        return self.state

    def release(self) -> None:
        if self._handle is not None:
            handle, self._handle = self._handle, None
            try:
                handle.release()
            except Exception:
                pass  # a transfer still in flight (after an error or timeout) may refuse: NIXL frees it with the agent


class NixlAgent:
    """A named NIXL agent with the UCX backend. Its calls are made from one thread at a time (the owner's lock)."""

    def __init__(self, name: str) -> None:
        api = _load()
        with _import_lock:  # the binding is swapped for the agent's construction only
            binding = api.nixlBind
            api.nixlBind = _Binding(binding)
            try:
                self._agent = api.nixl_agent(name, api.nixl_agent_config(backends=["UCX"]))
            except Exception as exc:
                raise NixlError(f"NIXL agent {name!r} could not start: {exc}") from exc
            finally:
                api.nixlBind = binding
        if "UCX" not in self._agent.backends:
            raise NixlError(f"NIXL agent {name!r} has no UCX backend (plugins found: {', '.join(self._agent.plugin_list) or 'none'})")
        self.name = name
        self._registered: dict[Region, Any] = {}

    def metadata(self) -> bytes:
        """What a peer needs to write to this agent's registered memory (send it on our own sockets)."""
        return self._agent.get_agent_metadata()

    def region_metadata(self, region: Region) -> bytes:
        """What a peer that loaded this agent's metadata before ``region`` was registered needs to write to it."""
        try:
            return self._agent.get_partial_agent_metadata(self._registered[region], False)
        except Exception as exc:
            raise NixlError(f"NIXL could not describe a registered region: {exc}") from exc

    def register(self, region: Region) -> None:
        try:
            self._registered[region] = self._agent.register_memory([(region.address, region.nbytes, region.device, "")], region.kind)
        except Exception as exc:
            raise NixlError(f"registering {region.nbytes} bytes of {region.kind} with NIXL failed: {exc}") from exc

    def deregister(self, region: Region) -> None:
        descs = self._registered.pop(region, None)
        if descs is not None:
            try:
                self._agent.deregister_memory(descs)
            except Exception:
                pass  # the agent goes with its memory anyway

    def add_remote(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns the peer's agent name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise NixlError(f"NIXL could not load the peer's agent metadata: {exc}") from exc
        return name.decode() if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception:
            pass  # not loaded, or already gone

    def write(self, local: Sequence[Region], remote: Sequence[Region], remote_agent: str, notification: bytes) -> Transfer:
        """Start one write of each ``local`` region (each inside memory registered here) to the ``remote`` region
        beside it (inside memory ``remote_agent`` registered), all of one memory kind on each side; the peer gets
        ``notification`` once every byte has landed."""
        return self._transfer("WRITE", local, remote, remote_agent, notification)

    def read(self, local: Sequence[Region], remote: Sequence[Region], remote_agent: str) -> Transfer:
        """Start one read of each ``remote`` region (inside memory ``remote_agent`` registered) into the ``local``
        region beside it (inside memory registered here): a worker pulling a weight update (dataplane/weights/)."""
        return self._transfer("READ", local, remote, remote_agent, b"")

    def _transfer(self, operation: str, local: Sequence[Region], remote: Sequence[Region], remote_agent: str, notification: bytes) -> Transfer:
        what = operation.lower()
        if len(local) != len(remote) or not local or any(a.nbytes != b.nbytes for a, b in zip(local, remote)):
            raise ValueError(f"a {what} moves equal lengths, not {[r.nbytes for r in local]} and {[r.nbytes for r in remote]}")
        nbytes = sum(region.nbytes for region in local)
        where = f"to {remote_agent}" if operation == "WRITE" else f"from {remote_agent}"
        try:
            here = self._agent.get_xfer_descs([(r.address, r.nbytes, r.device) for r in local], local[0].kind)
            there = self._agent.get_xfer_descs([(r.address, r.nbytes, r.device) for r in remote], remote[0].kind)
            handle = self._agent.initialize_xfer(operation, here, there, remote_agent, notification)
            state = self._agent.transfer(handle)
        except Exception as exc:
            raise NixlError(f"a NIXL {what} of {nbytes} bytes {where} could not start: {exc}") from exc
        transfer = Transfer(self, handle, state)
        if state == "ERR":
            transfer.release()
            raise NixlError(f"a NIXL {what} of {nbytes} bytes {where} failed to start")
        return transfer

    def notifications(self) -> dict[str, list[bytes]]:
        """Notifications that arrived since the last call: peer agent name -> messages, in arrival order."""
        try:
            return self._agent.get_new_notifs()
        except Exception as exc:
            raise NixlError(f"reading NIXL notifications failed: {exc}") from exc

    def close(self) -> None:
        for region in list(self._registered):
            descs = self._registered.pop(region)
            try:
                self._agent.deregister_memory(descs)
            except Exception:
                pass
        self._agent = None
