"""Huge-page malloc for the training process, where large supervision messages arrive.

libzmq allocates every received message afresh, and glibc maps chunks over 32 MB anew each time, so each
4 KiB page of each large message faults on first touch. With ``glibc.malloc.hugetlb=1`` glibc asks for
transparent huge pages for those mappings: 40 to 100 times fewer faults, and up to twice the receive rate
(docs/performance.md). glibc reads tunables only when a process starts, hence the re-exec.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger("draftfeed.producer")

TUNABLE = "glibc.malloc.hugetlb=1"


def hugepage_malloc_enabled(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    return TUNABLE in environ.get("GLIBC_TUNABLES", "").split(":")


def reexec_with_hugepage_malloc() -> None:
    """Restart this process in place (same pid, arguments and environment) with huge-page malloc enabled.

    Call it first thing in the training script, before any work: under torchrun each rank re-executes
    itself, keeping its pid, so the launcher notices nothing. Does nothing if already enabled, or where
    glibc is not the C library.
    """
    if hugepage_malloc_enabled() or not sys.platform.startswith("linux"):
        return
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES", ""), TUNABLE]))
    env = {**os.environ, "GLIBC_TUNABLES": tunables, "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", "1")}
    argv = [sys.executable, *sys.orig_argv[1:]] if hasattr(sys, "orig_argv") else [sys.executable, *sys.argv]
    log.info("draftfeed: restarting with %s for faster large receives", TUNABLE)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
