"""The names and bounds a training config's keys take, in one leaf module: the schema checks values
against them, and the modules that implement each choice read them from here."""
from placement.names import MAX_EXPERTS

ENGINES = ("torch", "deepspeed", "megatron")  # train/step/engines.py
MODEL_KINDS = ("tabular", "image", "lm", "text", "hf")  # train/build.py
PRECISIONS = ("fp32", "bf16")  # train/precision.py
EXPERT_KINDS = ("swiglu", "gelu", "lora")  # moe/experts.py
MEGATRON_DISPATCHERS = ("alltoall", "allgather")  # Megatron's own token dispatchers (integrations/megatron)
DEVICES = ("auto", "cpu", "cuda")  # distributed/process_group.py
# How long a collective may wait for a peer: below a second the group's own start-up (the store's
# rendezvous) times out before any peer could answer; beyond a week a hung peer is never reported,
# and far beyond, the backends' own timers overflow.
MIN_TIMEOUT_S, MAX_TIMEOUT_S = 1.0, 7 * 24 * 3600
# Every chunk is one more exchange per stage and direction, each with its latency: far below this
# the overlap has stopped paying, and a bound keeps per-chunk lists (bounds, hops, saved graphs) small
# whatever the config says (dispatch/pipeline.py).
MAX_PIPELINE_CHUNKS = 64
# A factor of E / K already lets every expert take every token (nothing drops), and E <= MAX_EXPERTS
# (routing/capacity.py)
MAX_CAPACITY_FACTOR = float(MAX_EXPERTS)
