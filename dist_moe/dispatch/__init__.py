"""The exchange, and nothing else: routed tokens moved to their experts and back.

contract.py       what a dispatcher takes (``Tokens``, ``Routes``) and what experts are (``ExpertsContract``)
exchange.py       the dispatch and combine stages a host runs, with ``ExchangeConfig``
dispatcher.py     ``LocalDispatcher`` and ``ExpertParallelDispatcher`` (rank or node dedup)
pipeline.py       one exchange cut into chunks, experts working while later chunks travel
all_to_all.py     the all-to-alls themselves: split sizes, the agreement header, payloads
apply_experts.py  the experts stage: each local expert on its slice of the pairs that arrived
combine.py        the fixed-order sums the combine and the experts stage add through
wire.py           the dtype rows travel in (parallel.wire_dtype)
weight_casts.py   an engine's expert weights cast once per forward, not per chunk
agree.py          every rank agrees that an exchange may run, or every rank raises the same error
profiling.py      the profiler's named ranges around each stage and wait

Process groups, devices and the routers' reductions are ``dist_moe.distributed``; the trainer's gradient
sums are ``dist_moe.train``.
"""
