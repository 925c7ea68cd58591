"""A Prometheus text page (what ``GET /metrics`` answers) read into samples, with prometheus_client's own parser."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]


def samples(text: str) -> dict[tuple[str, Labels], float]:
    """Every sample of the page by (name, sorted labels)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric(text: str, name: str, **labels: str) -> float | None:
    """The sum of the samples called ``name`` (a counter's with its ``_total``) whose labels include ``labels``; None
    when the page has none."""
    found = [value for (sample, have), value in samples(text).items() if sample == name and set(labels.items()) <= set(have)]
    return sum(found) if found else None
