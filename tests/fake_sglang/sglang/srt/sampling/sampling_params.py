from sglang._fake import SamplingParams  # noqa: F401
