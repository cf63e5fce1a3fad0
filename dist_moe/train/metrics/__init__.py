"""What a run measures and writes beside its model.

routing.py         routing metrics every run reports (load CV, tree distance, dropped slots)
experts.py         the GAR paper's expert-usage and specialization metrics
evaluate.py        validation metrics for every model kind, reduced over the ranks
step_bytes.py      the payload bytes of the training steps, and only theirs
routing_record.py  the routing record for dist-moe report / place / simulate
log.py             metrics.jsonl rows, reduced over the ranks once per log step
summary.py         summary.json, written once training ends
"""
