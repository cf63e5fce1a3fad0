"""Small reference models used by demos, tests and benchmarks."""
from dist_moe.models.regressor import MoERegressor
from dist_moe.models.tabular import TabularMoE

__all__ = ["MoERegressor", "TabularMoE"]
