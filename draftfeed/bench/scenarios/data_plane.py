"""Supervision from a synthetic worker to a rank against raw pyzmq DEALER->ROUTER, with and without hugetlb."""

from __future__ import annotations

import json
from pathlib import Path

from draftfeed.bench.harness import MB, Pipeline, Row, last_json, probe
from draftfeed.bench.synthetic import BYTES_PER_TOKEN, tokens_for

HUGETLB = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def raw_rate(nbytes: int, count: int, env: dict[str, str] | None) -> dict:
    receiver = probe(["raw-recv", str(nbytes), str(count)], env)
    assert receiver.stdout is not None
    endpoint = json.loads(receiver.stdout.readline())["endpoint"]
    sender = probe(["raw-send", endpoint, str(nbytes), str(count)])
    result = last_json(receiver)
    sender.communicate(timeout=120)
    return result


def run(quick: bool, workdir: Path) -> list[Row]:
    sizes = [16, 64] if quick else [16, 64, 256, 312.5]
    rows = []
    for size_mb in sizes:
        tokens = tokens_for(int(size_mb * MB))
        nbytes = tokens * BYTES_PER_TOKEN
        count = max(4, int((400 if quick else 2000) / size_mb))
        with Pipeline(workers=1, tokens=tokens, compute_ms=0) as pipeline:
            for label, env in (("", None), (" + hugetlb", HUGETLB)):
                raw = raw_rate(nbytes, count, env)
                ours = last_json(probe(["rank", pipeline.frontend, "bench", str(tokens), str(count), "2"], env))
                rows.append(
                    Row(
                        "data plane",
                        f"{size_mb:g} MB worker -> rank{label} ({ours['faults_per_msg']:.0f} page faults/msg)",
                        ours["bytes_per_s"] / 1e9,
                        raw["bytes_per_s"] / 1e9,
                        "GB/s",
                        f"raw pyzmq DEALER->ROUTER{label}",
                        ">= 0.8",
                    )
                )
    return rows
