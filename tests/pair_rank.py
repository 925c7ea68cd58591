"""A training rank in its own process, for tests that kill one: ``python tests/pair_rank.py BROKER SERVICE DATA_PLANE``.

Prints ``CLIENT <id>`` once connected, then ``BATCH i`` after each supervised batch, forever.
"""

from __future__ import annotations

import itertools
import sys

from conftest import make_batch

from draftfeed import RemoteEagle3Target


def main() -> None:
    broker, service, data_plane = sys.argv[1:4]
    with RemoteEagle3Target(broker, service, data_plane=data_plane) as remote:
        print(f"CLIENT {remote.rank_id}", flush=True)
        vocab = remote.model_info().vocab_size
        batches = (make_batch(2, 24, vocab, seed=i) for i in itertools.count())
        for i, _ in enumerate(remote.iterate(batches)):
            print(f"BATCH {i}", flush=True)


if __name__ == "__main__":
    main()
