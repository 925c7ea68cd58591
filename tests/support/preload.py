"""Preloaded starts: one process that has imported torch, transformers and the worker's modules once, and forks
each process asked of it from itself, so that a worker is ready in a fraction of the CPU time (about 3.8 s of a
2-core machine's CPU per worker otherwise, nearly all of it imports).

For the test suite, which starts many short-lived processes on one machine: ``use_preloaded_starts()`` makes
``launch`` the launcher of draftfeed/processes/commands.py, which offers it each start; it takes a ``python -m MODULE`` start with no prefix command (or ``ip netns exec
NAME``: the forked process enters that namespace itself) whose import-time environment (``IMPORT_TIME_ENV``) is the
preloader's. The forked process runs ``MODULE`` as ``python -m`` would,
in its own session, with the environment and arguments it was given and its output on a pipe; ``PreloadedPopen``
stands for it where a ``subprocess.Popen`` would: pid, poll, wait, signals, return code (negative for a signal).

Protocol, on a Unix socket: the client sends one JSON line ``{"module", "args", "env"}`` with the write end of its
output pipe attached (SCM_RIGHTS; two, stdout's and stderr's, to keep them apart); the preloader answers ``{"pid"}`` once forked and ``{"exit"}`` when the process
has exited, then closes the connection. The preloader is single-threaded when it forks, and ends when the process
that started it does, SIGKILLed or not (``children.spawn``); what it forked dies with it (``children.die_with_parent``).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from draftfeed.processes import children

# Read when a process starts (by the C libraries as they load, by Python itself, or by a preloaded module as it is
# imported: huggingface_hub reads whether it is offline then): a process forked from the preloader has the
# preloader's, so only a start with the same values is preloaded.
IMPORT_TIME_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "PYTHONPATH",
    "LD_PRELOAD",
    "LD_LIBRARY_PATH",
    "GLIBC_TUNABLES",
    "PYTHONHASHSEED",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
)
PRELOADED_MODULES = (
    "torch",
    "transformers",
    "transformers.models.llama.modeling_llama",
    "draftfeed.launch.cli",
    "draftfeed.consumers.worker",
    "draftfeed.consumers.engines.hf",
    "draftfeed.producers.tasks.base",
)
READY = "draftfeed-preloader ready"
START_TIMEOUT_S = 120.0  # for its imports, on a loaded machine


class PreloadedPopen:
    """A process forked by the preloader, as much of ``subprocess.Popen`` as draftfeed's process handling uses."""

    def __init__(self, args: list[str], pid: int, connection: socket.socket, stdout: IO[str]) -> None:
        self.args = args
        self.pid = pid
        self.stdout = stdout
        self.stderr: IO[str] | None = None
        self.returncode: int | None = None
        self._connection = connection
        self._lock = threading.Lock()

    def poll(self) -> int | None:
        return self._await_exit(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._await_exit(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _await_exit(self, timeout: float | None) -> int | None:
        with self._lock:
            if self.returncode is None:
                readable, _, _ = select.select([self._connection], [], [], timeout)
                if readable:
                    answer = _read_answer(self._connection, f"said how process {self.pid} exited")
                    self.returncode = int(answer["exit"])
                    self._connection.close()
            return self.returncode


def communicate(process: PreloadedPopen, timeout_s: float) -> subprocess.CompletedProcess:
    """Its stdout and stderr (started with ``separate_stderr``) read to their ends and its exit awaited, as
    ``subprocess.run(..., capture_output=True, text=True)`` would; killed if it has not exited within ``timeout_s``."""
    read: dict[str, str] = {}
    readers = [
        threading.Thread(target=lambda name=name, stream=stream: read.__setitem__(name, stream.read()), daemon=True)
        for name, stream in (("stdout", process.stdout), ("stderr", process.stderr))
    ]
    for reader in readers:
        reader.start()
    try:
        code = process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
        raise
    for reader in readers:
        reader.join(timeout_s)
    process.stdout.close()
    if process.stderr is not None:
        process.stderr.close()
    return subprocess.CompletedProcess(process.args, code, read.get("stdout", ""), read.get("stderr", ""))


def _read_answer(connection: socket.socket, what: str) -> dict:
    """The preloader's next JSON line on ``connection``; a RuntimeError if it ends before it ``what``."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(4096)
        if not chunk:
            raise RuntimeError(f"the preloader ended before it {what}")
        data += chunk
    return json.loads(data)


class Preloader:
    """The client of one preloader process, started with ``env`` (its import-time variables are every start's)."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = dict(env)
        self._folder = tempfile.mkdtemp(prefix="draftfeed-preload-")
        self.path = str(Path(self._folder) / "socket")
        self._server = children.spawn(  # it dies with this process; what it forks dies with it
            [sys.executable, __file__, self.path], env=self.env, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True
        )
        assert self._server.stdout is not None
        ready, _, _ = select.select([self._server.stdout], [], [], START_TIMEOUT_S)
        line = self._server.stdout.readline() if ready else ""
        if line.strip() != READY:
            self._server.kill()
            self._server.wait(10)
            raise RuntimeError(f"the preloader did not start within {START_TIMEOUT_S:.0f} s: {line!r} (exit code {self._server.poll()})")

    def serves(self, env: Mapping[str, str]) -> bool:
        return self._server.poll() is None and all(env.get(name) == self.env.get(name) for name in IMPORT_TIME_ENV)

    def popen(
        self, module: str, args: Sequence[str], env: Mapping[str, str], netns: str | None = None, separate_stderr: bool = False
    ) -> PreloadedPopen:
        """``python -m MODULE ARGS`` with ``env``, forked from the preloader; ``netns``: in that network namespace
        (``ip netns``), as ``ip netns exec NETNS`` would run it. Its stdout and stderr on one pipe (``.stdout``), or,
        ``separate_stderr``, on two (``.stdout`` and ``.stderr``)."""
        pipes = [os.pipe() for _ in range(2 if separate_stderr else 1)]
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            connection.connect(self.path)
            request = json.dumps({"module": module, "args": list(args), "env": dict(env), "netns": netns}).encode() + b"\n"
            socket.send_fds(connection, [request], [write_end for _read_end, write_end in pipes])
            pid = int(_read_answer(connection, f"forked {module}")["pid"])
        except BaseException:
            connection.close()
            for read_end, _write_end in pipes:
                os.close(read_end)
            raise
        finally:
            for _read_end, write_end in pipes:
                os.close(write_end)
        outputs = [os.fdopen(read_end, "r") for read_end, _write_end in pipes]
        process = PreloadedPopen([sys.executable, "-m", module, *args], pid, connection, outputs[0])
        process.stderr = outputs[1] if separate_stderr else None
        return process

    def run(self, module: str, args: Sequence[str], env: Mapping[str, str], timeout_s: float) -> subprocess.CompletedProcess:
        """``subprocess.run([python, -m, MODULE, *ARGS], capture_output=True, text=True)``, forked from here."""
        return communicate(self.popen(module, args, env, separate_stderr=True), timeout_s)

    def close(self) -> None:
        if self._server.poll() is None:
            self._server.terminate()
            try:
                self._server.wait(10)
            except subprocess.TimeoutExpired:
                self._server.kill()
        Path(self.path).unlink(missing_ok=True)
        os.rmdir(self._folder)


# ---------------------------------------------------------------- the suite's launcher
_PRELOADERS: dict[tuple[str | None, ...], Preloader] = {}


def network_namespace_of(prefix: Sequence[str]) -> str | None:
    """The namespace a prefix ``ip netns exec NAME`` runs its command in (a preloaded start enters it itself), else None."""
    parts = list(prefix)
    return parts[3] if len(parts) == 4 and parts[:3] == ["ip", "netns", "exec"] else None


def launch(module: str, args: Sequence[str], env: dict[str, str], prefix: Sequence[str]) -> PreloadedPopen | None:
    """draftfeed.processes.commands's launcher for the suite: workers and other ``python -m`` processes (not brokers),
    also those run in a network namespace, forked from the preloader of their import-time environment (started on
    first use); None (spawn it) for any other start."""
    netns = network_namespace_of(prefix)
    if (prefix and netns is None) or (module == "draftfeed.launch" and args[:1] != ["worker"]):
        return None
    return _preloader(env).popen(module, args, env, netns)


def run_two_ranks(module: str, args: Sequence[str], env: Mapping[str, str], timeout_s: float, what: str) -> None:
    """``python -m MODULE RANK ARGS`` as ranks 0 and 1 side by side (a reference computed by two processes of the test's
    own), both to their ends within ``timeout_s``; a rank that fails is an AssertionError naming ``what``, with its
    stderr's end. Neither outlives this call."""
    ranks = [popen_module(module, [str(rank), *args], env) for rank in (0, 1)]
    try:
        for rank in ranks:
            done = communicate(rank, timeout_s=timeout_s)
            assert done.returncode == 0, f"{what} failed:\n{done.stderr[-3000:]}"
    finally:
        for rank in ranks:
            rank.kill()


def run_module(module: str, args: Sequence[str], env: Mapping[str, str], timeout_s: float = 120) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` run to its end with ``env``, as ``subprocess.run(..., capture_output=True,
    text=True)`` would, forked from the preloader of its import-time environment: for the suite's many one-line
    commands (a usage error, a refusal), whose own imports would otherwise be most of their time."""
    return _preloader(env).run(module, args, env, timeout_s)


def popen_module(module: str, args: Sequence[str], env: Mapping[str, str], prefix: Sequence[str] = ()) -> PreloadedPopen:
    """``python -m MODULE ARGS`` started with ``env`` (and ``prefix``, none or ``ip netns exec NAME``), forked from
    the preloader of its import-time environment, its stdout and stderr apart: for a test's own client processes
    (``communicate`` reads them to their ends)."""
    netns = network_namespace_of(prefix)
    if prefix and netns is None:
        raise ValueError(f"a preloaded start takes no prefix but ip netns exec NAME: {list(prefix)}")
    return _preloader(env).popen(module, args, env, netns, separate_stderr=True)


def _preloader(env: Mapping[str, str]) -> Preloader:
    key = tuple(env.get(name) for name in IMPORT_TIME_ENV)
    preloader = _PRELOADERS.get(key)
    if preloader is None or not preloader.serves(env):
        preloader = _PRELOADERS[key] = Preloader(env)
    return preloader


def use_preloaded_starts() -> None:
    """From now on, start processes through ``launch``; the preloaders end with this process."""
    from draftfeed.processes import commands

    commands.use_launcher(launch)
    atexit.register(lambda: [preloader.close() for preloader in _PRELOADERS.values()])


# ---------------------------------------------------------------- the preloader process
def import_preloaded() -> None:
    """Import what a preloader holds (the Makefile does it once after each environment's install, which writes their
    bytecode)."""
    import importlib

    for name in PRELOADED_MODULES:
        importlib.import_module(name)


def serve(path: str) -> None:
    import_preloaded()
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    children: dict[int, socket.socket] = {}
    print(READY, flush=True)
    try:
        while os.getppid() == parent:
            readable, _, _ = select.select([listener, wakeup_read], [], [], 1.0)
            if wakeup_read in readable:
                os.read(wakeup_read, 4096)
            if listener in readable:
                connection, _ = listener.accept()
                started = _fork(connection, listener, wakeup_read, wakeup_write, *children.values())
                if started is not None:
                    children[started] = connection
            _reap(children)
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _fork(connection: socket.socket, *inherited: object) -> int | None:
    message, fds, _flags, _address = socket.recv_fds(connection, 1 << 20, 2)
    request = json.loads(message)
    if not fds:
        connection.close()
        return None
    preloader = os.getpid()
    pid = os.fork()
    if pid == 0:
        children.die_with_parent(preloader)
        _run_child(request, fds[0], fds[-1], connection, inherited)
    for fd in fds:
        os.close(fd)
    connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
    return pid


def _run_child(request: dict, output: int, errors: int, connection: socket.socket, inherited: Sequence[object]) -> None:
    """In the forked process: become ``python -m MODULE ARGS`` in a session of its own; never returns."""
    import runpy
    import traceback

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        connection.close()
        for item in inherited:
            item.close() if isinstance(item, socket.socket) else os.close(item)  # type: ignore[arg-type]
        os.setsid()
        if request.get("netns"):
            enter_network_namespace(request["netns"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(output, 1)
        os.dup2(errors, 2)
        for fd in {output, errors}:
            os.close(fd)
        os.close(devnull)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if exc.code is not None and not isinstance(exc.code, int):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            _exit_as_python_does()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_SLAVE, _MNT_DETACH = 0x4000, 0x80000, 2


def enter_network_namespace(name: str) -> None:
    """Move this (single-threaded) process into the network namespace ``ip netns add NAME`` made, as ``ip netns exec``
    does: the namespace, and a mount namespace of its own whose /sys shows that namespace's interfaces (UCX reads
    them there). Unlike ``ip netns exec`` it binds no files of /etc/netns/NAME over /etc (the namespaces draftfeed's
    tests make have none). Raises OSError naming the step that failed."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(result: int, what: str) -> None:
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"{what} for network namespace {name!r}: {os.strerror(error)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs on /sys")


def _exit_as_python_does() -> None:
    """What the interpreter does at exit before it ends: wait for non-daemon threads, then run the atexit functions
    (a process forked here ends with os._exit, which would skip both)."""
    import atexit
    import threading
    import traceback

    try:
        threading._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            try:
                connection.sendall(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
            except OSError:
                pass
            connection.close()


if __name__ == "__main__":
    serve(sys.argv[1])
