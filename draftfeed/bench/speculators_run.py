"""speculators' trainer as the bench and the tests run it on a machine without a GPU, and its per-step metrics kept.

``cpu_patches()``: speculators 0.9.0 puts its model on the local accelerator (``trainer.get_local_rank``) and
synchronises it around every timed step (``torch.accelerator.synchronize``); without a GPU both fail, so the first
returns "cpu" and the second does nothing. ``record_metrics(path)``: each record speculators logs to
"speculators.metrics" (a step's train metrics and its profile, or an epoch's validation) appended to ``path`` as one
JSON line. Neither changes what the trainer computes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

METRICS_LOGGER = "speculators.metrics"


def cpu_patches() -> None:
    import speculators.train.trainer as trainer
    import torch

    trainer.get_local_rank = lambda: "cpu"
    torch.accelerator.synchronize = lambda *args, **kwargs: None


class _Metrics(logging.Handler):
    def __init__(self, path: Path) -> None:
        super().__init__(level=logging.INFO)
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == METRICS_LOGGER and isinstance(record.msg, dict):
            with open(self.path, "a") as out:
                out.write(json.dumps(record.msg, default=repr) + "\n")


def record_metrics(path: str | Path) -> _Metrics:
    handler = _Metrics(Path(path))
    logging.getLogger().addHandler(handler)
    return handler


def read_metrics(path: Path) -> tuple[list[dict], list[dict]]:
    """The train records (a step's metrics and profile) and the validation records of a run."""
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in records if "train" in r], [r for r in records if "val" in r]


def main(argv: list[str]) -> int:
    """``python -m draftfeed.bench.speculators_run METRICS ARGS``: speculators' train with ARGS in this process (the
    draftfeed backend registered), on a CPU patched as above, its metrics appended to METRICS. ``--runs FILE``: each
    run the JSON list in FILE gives (``{"metrics": PATH, "args": [...]}``), one after the other in this process."""
    import torch

    from draftfeed.integrations.speculators.entry import main as entry

    if not torch.cuda.is_available():
        cpu_patches()
    runs = json.loads(Path(argv[1]).read_text()) if argv[0] == "--runs" else [{"metrics": argv[0], "args": argv[1:]}]
    handler = record_metrics(runs[0]["metrics"])
    for run in runs:
        handler.path = Path(run["metrics"])
        code = entry(["train", *run["args"]])
        if code != 0:
            return code
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main(sys.argv[1:]))
