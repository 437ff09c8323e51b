"""Swap files on one or more directories: run directories, extents, striping, cleanup."""

from tiermem.store.store import Extent, StripeLayout, SwapStore

__all__ = ["Extent", "StripeLayout", "SwapStore"]
