"""Every tensor the expert-parallel layer makes in forward and backward is made on its input's
device: factory calls always name a device. On a GPU node a tensor made on the CPU by default
breaks NCCL (which takes CUDA tensors only) or forces a copy and a host sync."""
from tests.support.dist_utils import run_workers

FACTORIES = ("tensor", "zeros", "ones", "full", "empty", "arange", "rand", "randn", "randint", "eye", "linspace")


def _device_worker(rank, world):
    import torch
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    from dist_moe import MoELayer
    from placement import Placement, Topology
    from tests.support.ep_checks import ROUTERS

    class Factories(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.missing = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = getattr(func, "__name__", "")
            if getattr(func, "__module__", None) in ("torch", "torch._C._VariableFunctions") and name in FACTORIES \
                    and kwargs.get("device") is None:
                import traceback

                self.missing.append(f"torch.{name} at {traceback.extract_stack(limit=3)[0]}")
            return func(*args, **kwargs)

    topo = Topology(("node", "gpu"), (2, world // 2))
    for name, cfg in ROUTERS.items():
        for dedup in ("none", "rank", "node"):
            torch.manual_seed(0)
            layer = MoELayer(8, 12, dict(cfg), topology=topo, placement=Placement.tree_prefix(8, topo),
                             group=dist.group.WORLD, dedup=dedup, capacity_factor=1.25 if name == "switch" else None)
            x = torch.randn(11, 8, requires_grad=True)
            kw = {"categories": torch.randint(0, 5, (11,))} if name.startswith("specdrop") else {}
            with Factories() as mode:
                y, aux = layer(x, **kw)
                (y.square().sum() + aux).backward()
            assert not mode.missing, (name, dedup, sorted(set(mode.missing)))


def test_the_layer_makes_every_tensor_on_its_inputs_device():
    run_workers(_device_worker, 2, timeout=240)
