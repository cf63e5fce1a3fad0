"""dist-moe: distributed Mixture-of-Experts routing for PyTorch."""
from dist_moe.moe.layer import MoELayer, MoELayerConfig
from dist_moe.routing import Router, Routing, build_router

__all__ = ["MoELayer", "MoELayerConfig", "Router", "Routing", "build_router"]
__version__ = "0.1.0"
