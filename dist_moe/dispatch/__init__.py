"""Everything in dist-moe that talks to torch.distributed lives in this package."""
