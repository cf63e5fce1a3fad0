"""Routing strategies: pure tensor math behind one contract (``base.py``)."""
from dist_moe.routing.base import Router, Routing
from dist_moe.routing.branch import BranchRouter
from dist_moe.routing.flat import DeepSeekV3Router, HashRouter, SkyworkRouter, SwitchRouter, UniformRouter
from dist_moe.routing.gar import gar_loss
from dist_moe.routing.registry import ROUTERS, build_router
from dist_moe.routing.specdrop import SpecDropRouter

__all__ = [
    "Routing", "Router", "build_router", "ROUTERS", "BranchRouter", "SpecDropRouter", "SwitchRouter",
    "DeepSeekV3Router", "SkyworkRouter", "HashRouter", "UniformRouter", "gar_loss",
]
