"""Supervision on the nixl plane against frames through the same pipeline, and against raw NIXL writes of the same
bytes between two processes: on one host with UCX's default transports, and between two network namespaces
(draftfeed/bench/hosts.py, where this process may make them) over UCX's tcp transport, as between machines
without RDMA. The rank's page faults per message show that its receive slots are reused."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from draftfeed.bench.harness import MB, Pipeline, Row, last_json, probe
from draftfeed.bench.synthetic import BYTES_PER_TOKEN, tokens_for
from draftfeed.dataplane.nixl.transport import unavailable

UCX_TCP = {"UCX_TLS": "tcp"}


def raw_nixl_rate(workdir: Path, nbytes: int, count: int, env: dict[str, str] | None, sender: Sequence[str], receiver: Sequence[str]) -> dict:
    metadata = workdir / f"raw-nixl-{nbytes}.md"
    receiving = probe(["raw-nixl-recv", str(metadata), str(nbytes), str(count)], env, prefix=receiver)
    assert receiving.stdout is not None
    address = json.loads(receiving.stdout.readline())["address"]
    result = last_json(probe(["raw-nixl-send", str(metadata), str(address), str(nbytes), str(count)], env, prefix=sender))
    receiving.communicate(timeout=120)
    return result


def measure(
    workdir: Path, sizes: Sequence[float], quick: bool, where: str, host: str, env: dict | None, worker: Sequence[str], rank: Sequence[str]
) -> list[Row]:
    rows = []
    for size_mb in sizes:
        tokens = tokens_for(int(size_mb * MB))
        nbytes = tokens * BYTES_PER_TOKEN
        count = max(4, int((300 if quick else 3000) / size_mb))  # 3 GB a case: one stall of a slot made mid-run costs little
        with Pipeline(workers=1, tokens=tokens, compute_ms=0, data_plane="nixl", host=host, prefix=worker, env=env) as pipeline:
            args = ["rank", pipeline.frontend, "bench", str(tokens), str(count), "2"]
            over_frames = last_json(probe([*args, "frames"], env, prefix=rank))
            over_nixl = last_json(probe([*args, "nixl"], env, prefix=rank))
        if over_nixl["received_over_nixl"] < count:
            raise RuntimeError(f"only {over_nixl['received_over_nixl']} of {count} answers came over nixl")
        raw = raw_nixl_rate(workdir, nbytes, count, env, sender=worker, receiver=rank)
        case = f"{size_mb:g} MB worker -> rank, nixl {where} ({over_nixl['faults_per_msg']:.0f} page faults/msg; frames {over_frames['faults_per_msg']:.0f})"
        rows.append(
            Row(
                "nixl plane",
                f"{case}, against frames",
                over_nixl["bytes_per_s"] / 1e9,
                over_frames["bytes_per_s"] / 1e9,
                "GB/s",
                "frames plane, same pipeline",
                ">= 1",
            )
        )
        rows.append(
            Row(
                "nixl plane",
                f"{case}, against raw NIXL",
                over_nixl["bytes_per_s"] / 1e9,
                raw["bytes_per_s"] / 1e9,
                "GB/s",
                "raw NIXL writes, two processes",
                ">= 0.9",
            )
        )
    return rows


def run(quick: bool, workdir: Path) -> list[Row]:
    problem = unavailable()
    if problem is not None:
        raise RuntimeError(f"the nixl scenario needs NIXL: {problem}")
    sizes = [16, 64] if quick else [16, 64, 256, 312.5]
    rows = measure(workdir, sizes, quick, "on one host, UCX default transports", "127.0.0.1", None, (), ())
    from draftfeed.bench.hosts import Hosts, unavailable_reason

    if unavailable_reason() is None:
        with Hosts(["worker", "rank"], subnet="10.78.0") as hosts:
            rows += measure(
                workdir, sizes, quick, "across namespaces, UCX tcp", hosts.address("worker"), UCX_TCP, hosts.command("worker"), hosts.command("rank")
            )
    return rows
