"""A training rank iterating in a background thread of the test process, for the fault tests: every batch it sent
must come back once, in order, equal to the in-process computation."""

from __future__ import annotations

import threading

from conftest import assert_supervision_equal, make_batch, reference_eagle3

from draftfeed import RemoteEagle3Target

SERVICE = "svc"
SLOW = ["--engine", "fake_engines:FakeSlowEngine", "--service", SERVICE]


class RankRun(threading.Thread):
    """A training rank iterating in the background; ``results`` fills as it goes."""

    def __init__(self, frontend: str, batches: list[dict], depth: int = 2, keep_open: bool = False, **kwargs) -> None:
        super().__init__(daemon=True)
        self.frontend, self.batches, self.depth, self.kwargs = frontend, batches, depth, kwargs
        self.results: list[tuple[dict, object]] = []
        self.error: BaseException | None = None
        self.target: RemoteEagle3Target | None = None
        self.finished = threading.Event()
        self.release = threading.Event()
        if not keep_open:
            self.release.set()

    def run(self) -> None:
        try:
            with RemoteEagle3Target(self.frontend, SERVICE, prefetch_depth=self.depth, **self.kwargs) as target:
                self.target = target
                for batch, supervision in target.iterate(self.batches):
                    self.results.append((batch, supervision))
                self.finished.set()
                self.release.wait(120)
        except BaseException as exc:
            self.error = exc
        finally:
            self.finished.set()

    def check(self, model, timeout_s: float = 150.0) -> None:
        """Every batch once, in order, bit-exact."""
        self.release.set()
        self.join(timeout_s)
        assert not self.is_alive(), "the rank did not finish"
        if self.error is not None:
            raise self.error
        assert len(self.results) == len(self.batches)
        for (got_batch, supervision), batch in zip(self.results, self.batches):
            assert got_batch is batch, "out of order"
            assert_supervision_equal(supervision, reference_eagle3(model, batch, [1, 3, 4]))


def batches(count: int, seed: int = 0) -> list[dict]:
    return [make_batch(2, 16, 1000, seed=seed * 1000 + i) for i in range(count)]
