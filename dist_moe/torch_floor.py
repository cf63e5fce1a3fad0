"""The oldest torch dist-moe runs on, and the torch API that sets it.

pyproject.toml requires ``torch>=`` this floor and no newer: a GPU image's CUDA build of torch that is
at least this old is kept at install, not replaced by (or, offline, refused for) a newer wheel.
tests/architecture/test_torch_floor.py holds pyproject to ``TORCH_FLOOR`` and checks, on whichever torch is
installed, that every torch name the code reaches exists and takes the keywords it is given.
"""

# (the newest torch API dist-moe calls, where and why, the first torch release that has it).
# torch 2.9 has the private torch._grouped_mm (with a CPU kernel), not the public name.
NEWEST_API = ("torch.nn.functional.grouped_mm", "dist_moe/moe/experts.py: each expert projection as one grouped GEMM",
              (2, 10))
TORCH_FLOOR = NEWEST_API[2]
