"""Small reference models used by demos, tests and benchmarks."""
from dist_moe.models.tabular import TabularMoE

__all__ = ["TabularMoE"]
