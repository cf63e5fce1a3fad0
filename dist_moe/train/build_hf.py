"""``model.kind: hf``: a user's transformers MoE model on a local text or token file, its experts
sharded over its expert-parallel group (parallel.ep_size: default the world) and dispatched by dist-moe."""
from __future__ import annotations

import sys

from dist_moe.data.local_text import check_uncategorized, is_local, local_split
from dist_moe.integrations.transformers.hosted import host_experts
from dist_moe.models.hf_model import (
    HFCausalLM,
    has_tokenizer,
    has_weights,
    load_config,
    load_model,
    load_tokenizer,
    model_folder,
    parameter_count,
)
from dist_moe.optional_engines import engine_import
from dist_moe.train.rank_memory import available_per_rank


def hf_data_and_model(cfg, rt):
    dcfg, folder = cfg.data, model_folder(cfg.model.path)
    if not is_local(dcfg.name):
        raise ValueError(f"model.kind=hf trains on a local text file, folder or .npy / .bin token file: data.name="
                         f"{dcfg.name!r} is none")
    config = load_config(folder)  # its sizes checked (check_config) before anything is built
    longest = getattr(config, "max_position_embeddings", None)
    if isinstance(longest, int) and dcfg.seq_len > longest:
        raise ValueError(f"data.seq_len={dcfg.seq_len} is longer than the model's max_position_embeddings={longest}")
    # loaded once, now: a tokenizer that cannot load fails before training, and the one exported with the
    # trained model is this, whatever happens to the folder's files meanwhile
    tokenizer = load_tokenizer(folder) if has_tokenizer(folder) else None
    check_uncategorized(dcfg.name, dcfg.categories)
    data = local_split(dcfg.name, dcfg.seq_len, dcfg.val_fraction, cfg.seed, config.vocab_size, dcfg.token_dtype,
                       tokenizer=folder if tokenizer is not None else None, memory=available_per_rank()[0])
    check_hf_fits(cfg, folder, config, rt.ep_size)
    if not rt.is_main:  # one progress bar for the weights, not one per rank
        engine_import("transformers.utils", "logging").disable_progress_bar()
    hf = load_model(folder, cfg.seed)
    if rt.is_main and not has_weights(folder):
        print(f"dist-moe: model.path={str(folder)!r} holds no weights: training starts from random ones (seed "
              f"{cfg.seed})", file=sys.stderr)
    host_experts(hf, rt.placement, rt.ep_topology(), rt.moe_group, rt.exchange)
    return data, HFCausalLM(hf, folder, tokenizer)


def hf_training_bytes(cfg, folder, config, ep_size: int) -> int:
    """About how much memory one rank needs, the larger of loading and training. Loading: the whole model
    in fp32 (every rank loads it, then keeps its share of the experts). Training: fp32 weights, gradients
    and Adam's two moments (its 1/ep_size of the experts), and one batch's activations (a dozen hidden-size
    vectors per token and layer, the attention scores and the logits, each with its gradient)."""
    dense, experts = parameter_count(folder)
    share = -(-experts // ep_size)
    tokens = cfg.train.batch_size * cfg.data.seq_len
    hidden, layers = config.hidden_size, config.num_hidden_layers
    heads = getattr(config, "num_attention_heads", 1)
    per_token = layers * (12 * hidden + heads * cfg.data.seq_len) + 2 * config.vocab_size
    loading = 4 * (dense + experts + share)
    return max(loading, 4 * 4 * (dense + share) + 2 * 4 * tokens * per_token)


def check_hf_fits(cfg, folder, config, ep_size: int) -> None:
    needed = hf_training_bytes(cfg, folder, config, ep_size)
    free, local = available_per_rank()
    if needed > free:
        raise ValueError(f"model.path={str(folder)!r} with train.batch_size={cfg.train.batch_size}, data.seq_len="
                         f"{cfg.data.seq_len} needs about {needed / 2**30:.3g} GiB per rank to train (weights, "
                         f"gradients, Adam, activations), more than the {free / 2**30:.1f} GiB available"
                         f"{f' to each of {local} ranks here' if local > 1 else ''}")
