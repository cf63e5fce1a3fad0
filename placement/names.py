"""The names and bounds placement's functions take, in a leaf module (no torch): the training config's
schema checks them without importing the implementations."""

MAX_EXPERTS = 1 << 16  # any router's and placement's: 65,536 is far beyond published MoE models (DeepSeek-V3: 256)
# the strategies a training config or `dist-moe simulate` names (optimized needs co-activation: a file)
NAMED = ("contiguous", "round_robin", "tree_prefix")
DEDUP_MODES = ("none", "rank", "node")
EP_LAYOUTS = ("contiguous", "strided")  # an expert-parallel group's ranks: consecutive, or every R-th
