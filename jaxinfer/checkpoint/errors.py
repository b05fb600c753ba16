"""The checkpoint package's error type (imported by its readers)."""


class CheckpointError(ValueError):
  """A checkpoint that does not match its config or cannot be read."""
