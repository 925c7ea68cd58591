from sglang._fake import SpeculativeAlgorithm  # noqa: F401
