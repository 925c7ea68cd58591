from sglang._fake import ModelConfig  # noqa: F401
