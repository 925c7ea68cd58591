"""Supervision and small requests through a --secure pipeline (CURVE everywhere) against the same pipeline
in plaintext, in the same run."""

from __future__ import annotations

from pathlib import Path

from draftfeed.bench.harness import MB, Pipeline, Row, last_json, probe
from draftfeed.bench.synthetic import tokens_for


def run(quick: bool, workdir: Path) -> list[Row]:
    from draftfeed.security.keys import generate

    keys = workdir / "bench-keys"
    if not (keys / "broker.key_secret").exists():
        generate(keys)
    rows = []
    for size_mb in [16] if quick else [16, 64]:
        tokens = tokens_for(int(size_mb * MB))
        count = max(4, int((300 if quick else 1500) / size_mb))
        rates = {}
        for label, folder in (("plaintext", None), ("curve", keys)):
            with Pipeline(workers=1, tokens=tokens, compute_ms=0, keys=folder) as pipeline:
                env = {"DRAFTFEED_KEYS": str(folder)} if folder else None
                rates[label] = last_json(probe(["rank", pipeline.frontend, "bench", str(tokens), str(count), "2", "frames"], env))["bytes_per_s"]
        rows.append(
            Row(
                "encryption",
                f"{size_mb:g} MB supervision, CURVE",
                rates["curve"] / 1e9,
                rates["plaintext"] / 1e9,
                "GB/s",
                "the same pipeline in plaintext",
            )
        )
    count = 1000 if quick else 5000
    rates = {}
    for label, folder in (("plaintext", None), ("curve", keys)):
        with Pipeline(workers=2, tokens=1, compute_ms=0, capacity=32, keys=folder) as pipeline:
            env = {"DRAFTFEED_KEYS": str(folder)} if folder else None
            rates[label] = last_json(probe(["rank", pipeline.frontend, "bench", "1", str(count), "32", "frames"], env))["seconds"]
    rows.append(
        Row(
            "encryption",
            "1-token requests, CURVE",
            count / rates["curve"],
            count / rates["plaintext"],
            "requests/s",
            "the same pipeline in plaintext",
        )
    )
    return rows
