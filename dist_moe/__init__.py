"""dist-moe: distributed Mixture-of-Experts routing for PyTorch."""
from dist_moe.layer import MoELayer
from dist_moe.routing import Router, Routing, build_router

__all__ = ["MoELayer", "Router", "Routing", "build_router"]
__version__ = "0.1.0"
