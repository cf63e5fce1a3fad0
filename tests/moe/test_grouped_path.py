"""Where the experts' grouped GEMM runs as torch's own kernel, and where they loop instead: on a GPU torch's
fast kernel is bf16 on compute capability 9.x/10.x (elsewhere F.grouped_mm reads its offsets to the host per
projection), needs 16-byte aligned data, and the rank line says which way a run computes."""
import torch

from dist_moe.distributed.rank_line import rank_line
from dist_moe.moe.experts import aligned, experts_path, grouped_kernel, grouped_ok

GPU, CPU = torch.device("cuda", 0), torch.device("cpu")


def test_the_fast_kernel_is_bf16_on_hopper_and_blackwell_only():
    assert grouped_kernel(GPU, torch.bfloat16, (9, 0)) and grouped_kernel(GPU, torch.bfloat16, (10, 0))
    for dtype, capability in ((torch.float32, (9, 0)), (torch.float16, (9, 0)), (torch.bfloat16, (8, 0)),
                              (torch.bfloat16, (12, 0))):
        assert not grouped_kernel(GPU, dtype, capability), (dtype, capability)
    assert all(grouped_kernel(CPU, d) for d in (torch.float32, torch.bfloat16, torch.float16))


def test_the_rank_line_says_which_way_the_experts_compute_on_a_gpu():
    assert experts_path(GPU, torch.bfloat16, (9, 0)) == "grouped GEMM (bfloat16)"
    loop = experts_path(GPU, torch.float32, (9, 0))
    assert loop.startswith("per-expert loop (float32")
    line = rank_line(0, 2, "2.13.0+cu128", GPU, "nccl", "NVIDIA H100", loop)
    assert line.endswith(f", experts: {loop}")
    assert "experts" not in rank_line(0, 1, "2.13.0+cpu", CPU, None)


def test_alignment_is_checked_on_data_pointers():
    base = torch.zeros(65)
    assert base.data_ptr() % 16 == 0 and aligned([base[:64].reshape(4, 16)])  # torch's allocator aligns storage
    shifted = base[1:].reshape(4, 16)  # 4 bytes in: not 16-byte aligned
    assert not aligned([shifted])
    # the CPU's grouped_mm takes any alignment: grouped_ok only asks it of a GPU's tensors
    w = torch.zeros(2, 16, 16)
    assert grouped_ok(shifted, [w])
