"""Health and metrics over HTTP for broker, workers and ranks (docs/operations.md, "Health and metrics"). No torch."""
