from sglang._fake import ModelRunner, ModelRunnerOutput  # noqa: F401
