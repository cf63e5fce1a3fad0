"""The names and bounds a training config's keys take, in one leaf module: the schema checks values
against them, and the modules that implement each choice read them from here."""
from placement.names import MAX_EXPERTS

ENGINES = ("torch", "deepspeed", "megatron")  # train/step/engines.py
MODEL_KINDS = ("tabular", "image", "lm", "text", "hf")  # train/build.py
PRECISIONS = ("auto", "fp32", "bf16")  # train/precision.py (auto: bf16 on a GPU, fp32 on the CPU)
EXPERT_KINDS = ("swiglu", "gelu", "lora")  # moe/experts.py
# MoELayerConfig's defaults (moe/layer.py) for the options a training config passes to its layers as they are:
# the schema may not import the layer, so a test holds the two equal
SHARED_EXPERT_HIDDEN, LORA_RANK, LORA_ALPHA = 0, 8, 16.0
# what the engines' hosts build (train/step/engines.py): DeepSpeed's and Megatron-core's MoE layers hold no
# shared expert, and Megatron's experts are its own MLPs (integrations/megatron/hosts.py), without LoRA
SHARED_EXPERT_ENGINES = ("torch",)
MEGATRON_EXPERT_KINDS = ("swiglu", "gelu")
MEGATRON_DISPATCHERS = ("alltoall", "allgather")  # Megatron's own token dispatchers (integrations/megatron)
# the dtype an exchange's rows travel in (dispatch/wire.py; auto: the experts' compute dtype)
WIRE_DTYPES = ("auto", "fp32", "bf16", "fp8")
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
# the release that stops reading the deprecated config keys (parallel.megatron_dispatcher,
# parallel.deepspeed_dispatcher, router.gar): the minor release after dist_moe.__version__; a test fails once
# the version reaches it, while they are still read
DEPRECATED_KEYS_REMOVED_IN = "0.2.0"
