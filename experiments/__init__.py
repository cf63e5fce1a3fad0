"""Experiments behind docs/RESULTS.md: each table is one `python -m experiments.run NAME` away."""
