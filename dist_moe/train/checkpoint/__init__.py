"""Checkpoints: saved atomically, verified before they are trusted, resharded across world and EP sizes.

store.py   save, verify, load and find the latest (torch.distributed.checkpoint)
files.py   what a load may read: the files its manifest lists, checked, and nothing else
dcp.py     DCP's reader, planner and file system over those verified files
state.py   where training stands (step, data cursor, random streams), saved and restored with the weights
"""
