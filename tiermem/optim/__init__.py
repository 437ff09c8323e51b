"""Optimizer state in tiers: fp32 gradient accumulators, master weights and moments per unit, updated on the CPU."""

from tiermem.optim.optimizer import SUPPORTED_OPTIMIZERS, StateTensor, TieredOptimizer, UnitOptimState, unsupported

__all__ = ["SUPPORTED_OPTIMIZERS", "StateTensor", "TieredOptimizer", "UnitOptimState", "unsupported"]
