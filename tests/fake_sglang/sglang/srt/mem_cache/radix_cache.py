from sglang._fake import RadixCache  # noqa: F401
