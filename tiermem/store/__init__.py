"""Swap files on one or more directories: run directories, extents, striping, cleanup."""

from tiermem.store.store import Extent, SwapStore

__all__ = ["Extent", "SwapStore"]
