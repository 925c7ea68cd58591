"""Supervision on a gloo pair group against frames through the same pipeline, and against raw gloo."""

from __future__ import annotations

import json
from pathlib import Path

from draftfeed.bench.harness import MB, Pipeline, Row, last_json, probe
from draftfeed.bench.synthetic import BYTES_PER_TOKEN, tokens_for


def raw_gloo_rate(nbytes: int, count: int) -> dict:
    receiver = probe(["raw-gloo-recv", str(nbytes), str(count)])
    assert receiver.stdout is not None
    port = json.loads(receiver.stdout.readline())["port"]
    sender = probe(["raw-gloo-send", str(port), str(nbytes), str(count)])
    result = last_json(receiver)
    sender.communicate(timeout=120)
    return result


def run(quick: bool, workdir: Path) -> list[Row]:
    sizes = [16, 64] if quick else [16, 64, 256]
    rows = []
    for size_mb in sizes:
        tokens = tokens_for(int(size_mb * MB))
        nbytes = tokens * BYTES_PER_TOKEN
        count = max(4, int((300 if quick else 1500) / size_mb))
        with Pipeline(workers=1, tokens=tokens, compute_ms=0, data_plane="gloo") as pipeline:
            over_frames = last_json(probe(["rank", pipeline.frontend, "bench", str(tokens), str(count), "2", "frames"]))
            over_pair = last_json(probe(["rank", pipeline.frontend, "bench", str(tokens), str(count), "2", "gloo"]))
        if over_pair["received_over_pair"] < count:
            raise RuntimeError(f"only {over_pair['received_over_pair']} of {count} answers came on the gloo group")
        raw = raw_gloo_rate(nbytes, count)
        case = f"{size_mb:g} MB worker -> rank on a gloo pair group"
        rows.append(
            Row(
                "pair plane",
                f"{case}, against frames",
                over_pair["bytes_per_s"] / 1e9,
                over_frames["bytes_per_s"] / 1e9,
                "GB/s",
                "frames plane, same pipeline",
            )
        )
        rows.append(
            Row(
                "pair plane",
                f"{case}, against raw gloo",
                over_pair["bytes_per_s"] / 1e9,
                raw["bytes_per_s"] / 1e9,
                "GB/s",
                "raw gloo send/recv of one tensor",
                ">= 0.8",
            )
        )
    return rows
