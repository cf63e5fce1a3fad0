"""Process groups and devices, below everything that runs collectives.

process_group.py  joining the launched group (gloo or NCCL), leaving it, a failed collective in one line
device_choice.py  the device a rank computes on (parallel.device)
groups.py         groups held weakly, so destroy_process_group frees them; cached subgroups
reductions.py     the sums routers, GAR and the trainer call instead of torch.distributed
every_rank.py     a start-up check whose error is raised on every rank
collective_order.py  one order of collectives on every rank: no gradient sum before the step's exchanges
rank_line.py      the line each rank prints at start
"""
