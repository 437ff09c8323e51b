"""The tiermem exception hierarchy: every error tiermem raises on purpose derives from TiermemError."""

from __future__ import annotations


class TiermemError(Exception):
    """Root of every error tiermem raises deliberately; catch this to handle them all."""


class ConfigError(TiermemError, ValueError):
    """A configuration value is wrong; the message names the key path and the fix."""


class IOEngineError(TiermemError):
    """The I/O engine cannot be set up as asked (missing backend, bad setting)."""


class StoreError(TiermemError):
    """The swap store cannot place or find data (full disk, locked or corrupt run directory)."""


class BudgetError(TiermemError):
    """A memory budget can never be met by the request that was made."""
