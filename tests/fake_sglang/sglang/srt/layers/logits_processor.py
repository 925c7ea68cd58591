from sglang._fake import LogitsMetadata, LogitsProcessor, LogitsProcessorOutput  # noqa: F401
