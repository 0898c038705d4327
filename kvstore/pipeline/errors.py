"""The pipeline's errors: one root, so the CLI reports every refusal the same way (exit 1)."""

from __future__ import annotations


class PipelineError(Exception):
    """A pipeline job could not do what was asked; the message says why and what to do."""


class SnapshotError(PipelineError):
    """No usable snapshot, or one that does not fit the WAL it is meant to continue."""


class WalGapError(PipelineError):
    """The WAL no longer holds records a job needs (truncated below them), and no snapshot
    covers the gap."""
