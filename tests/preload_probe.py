"""A process for tests/test_preload.py: prints what it was started with, then exits, waits or fails as asked.

python -m preload_probe exit CODE | wait | raise | where
"""

from __future__ import annotations

import os
import sys
import time


def main() -> int:
    preloaded = int("torch" in sys.modules)  # a forked process has the preloader's modules already
    import torch

    described = f"value={os.environ.get('PROBE_VALUE')} session={os.getsid(0)} torch={preloaded} threads={torch.get_num_threads()}"
    if sys.argv[1:2] == ["where"]:  # which network namespace it runs in, and the interfaces its /sys shows
        interfaces = ",".join(sorted(os.listdir("/sys/class/net")))
        print(f"probe netns={os.stat('/proc/self/ns/net').st_ino} interfaces={interfaces}", flush=True)
        return 0
    print(f"probe argv={sys.argv[1:]} {described}", flush=True)
    if sys.argv[1] == "exit":
        return int(sys.argv[2])
    if sys.argv[1] == "raise":
        raise RuntimeError("the probe was asked to fail")
    time.sleep(60)  # until signalled
    return 0


if __name__ == "__main__":
    sys.exit(main())
