"""A run's data and model from its config: tabular, image, LM or text, hosted by the run's engine."""
from __future__ import annotations

import math
from dataclasses import replace

from dist_moe.config.choices import MODEL_KINDS
from dist_moe.data.corpus import lm_split
from dist_moe.data.local_text import check_uncategorized, is_local, local_split
from dist_moe.data.tabular import tabular_split
from dist_moe.data.text_tasks import text_split
from dist_moe.models import TabularMoE
from dist_moe.models.image import ImageMoE
from dist_moe.models.text import TextMoE
from dist_moe.models.tiny_lm import VOCAB, TinyMoELM
from dist_moe.moe.experts import expert_parameters
from dist_moe.routing.registry import RouterKeyError
from dist_moe.train.build_hf import hf_data_and_model
from dist_moe.train.layer_config import layer_config
from dist_moe.train.rank_memory import available_per_rank


def categorised_router(cfg, data):
    """The run's router config, with SpecDrop's num_categories taken from the data when not given."""
    router = cfg.router
    if router.type != "specdrop":
        return router
    if data.category_names is None:
        raise ValueError("router.type=specdrop routes by category: set data.categories "
                         "(e.g. satimage_landcover with data.name=satimage)")
    n = len(data.category_names)
    if router.num_categories not in (None, n):
        raise ValueError(f"router.num_categories={router.num_categories!r} but data.categories="
                         f"{cfg.data.categories!r} has {n} categories")
    return replace(router, num_categories=n)


TEXT_HIDDEN = 384  # MiniLM's states, which the text model's MoE reads

# model.kind -> the dataset it trains on (tabular: any keel dataset; hf: a local text or token file)
DATA_OF_KIND = {"tabular": None, "image": "fashion_mnist", "lm": "corpus", "text": "text_tasks"}
assert (*DATA_OF_KIND, "hf") == MODEL_KINDS  # the schema's names (config/choices.py) are these


def data_and_model(cfg, rt):
    """(data split, model) for ``cfg`` (a ``RunConfig``); ``rt`` (a ``Runtime``) builds each MoE layer. A bad router key
    is named as the config names it (``router.mlp_hidden``)."""
    try:
        data, model = _data_and_model(cfg, rt)
    except RouterKeyError as e:
        raise e.under("router") from None
    if len(data.x_train) < rt.world:  # a rank without rows would train on nothing, every step
        raise ValueError(f"data.name={cfg.data.name!r} leaves {len(data.x_train)} training rows for "
                         f"{rt.world} ranks: every rank needs at least one (raise data.max_rows)")
    return data, model


def _data_and_model(cfg, rt):
    dcfg, mcfg, kind, seed = cfg.data, cfg.model, cfg.model.kind, cfg.seed
    if kind == "hf":
        return hf_data_and_model(cfg, rt)
    wants = {k: v for k, v in DATA_OF_KIND.items() if v is not None}
    local = kind == "lm" and dcfg.name != DATA_OF_KIND["lm"] and is_local(dcfg.name)  # the built-in name wins
    if not local and wants.get(kind) != (dcfg.name if dcfg.name in wants.values() else None):
        raise ValueError(f"model.kind={kind!r} needs data.name={wants.get(kind, 'a keel dataset')}"
                         f"{' or a local text or token file' if kind == 'lm' else ''}, got {dcfg.name!r}")
    if kind == "lm":
        if mcfg.label_mask or not mcfg.d_model:
            raise ValueError("model.kind=lm needs model.d_model > 0 and model.label_mask: false")
        if local:
            check_uncategorized(dcfg.name, dcfg.categories)
            data = local_split(dcfg.name, dcfg.seq_len, dcfg.val_fraction, seed, VOCAB, dcfg.token_dtype,
                               memory=available_per_rank()[0])
        else:
            data = lm_split(dcfg.seq_len, dcfg.per_domain, dcfg.val_fraction, seed, dcfg.categories)
        check_model_fits(cfg, rt.ep_size)
        router = categorised_router(cfg, data)
        build = lambda i: rt.build_moe(layer_config(cfg, mcfg.d_model, router))  # noqa: E731
        model = TinyMoELM(build, mcfg.d_model, mcfg.layers, mcfg.heads, max_len=dcfg.seq_len)
        model.class_category = None  # categories come from the data, not from classes
        return data, model
    if kind == "text":
        if dcfg.categories not in (None, "tasks"):
            raise ValueError(f"data.categories for text_tasks must be 'tasks' or null, got {dcfg.categories!r}")
        data = text_split(dcfg.per_domain, dcfg.seq_len, dcfg.val_fraction, seed)
        check_model_fits(cfg, rt.ep_size, classes=sum(data.task_classes))
        router = categorised_router(cfg, data)
        moe = rt.build_moe(layer_config(cfg, TEXT_HIDDEN, router))
        return data, TextMoE(moe, data.task_classes)
    data = tabular_split(dcfg.name, dcfg.val_fraction, seed, dcfg.max_rows, dcfg.categories)
    router = categorised_router(cfg, data)
    features = data.x_train.shape[1]
    check_model_fits(cfg, rt.ep_size, features, data.num_classes)
    moe = rt.build_moe(layer_config(cfg, mcfg.d_model or features, router))
    model_cls = ImageMoE if kind == "image" else TabularMoE
    return data, model_cls(features, data.num_classes, moe, class_category=data.class_category, **mcfg.block_keys())


def training_bytes(cfg, ep_size: int, features: int = 0, classes: int = 0) -> int:
    """About how much memory one rank needs to train ``cfg``'s model: fp32 weights with their gradients
    and Adam's two moments (its 1/ep_size of the experts), and one batch's activations kept for the
    backward. Python ints: a size too large for any tensor is still counted, never overflows."""
    m, r, kind = cfg.model, cfg.router, cfg.model.kind
    hidden = {"lm": m.d_model, "text": TEXT_HIDDEN}.get(kind, m.d_model or features)
    moe_layers = m.layers if kind == "lm" else 1
    experts = expert_parameters(math.ceil(r.num_experts / ep_size), hidden, m.ffn_hidden_size, m.expert_type,
                                m.lora_rank)
    shared = expert_parameters(1, hidden, m.shared_expert_hidden, "swiglu")  # on every rank, whole
    weights = moe_layers * (experts + shared + r.num_experts * hidden) + hidden * classes
    if kind == "lm":  # attention, embeddings, positions, the byte head
        weights += m.layers * 4 * hidden * hidden + (2 * VOCAB + cfg.data.seq_len) * hidden
    elif kind in ("tabular", "image"):  # the input projection (the image stem's last linear)
        weights += (32 * 7 * 7 if kind == "image" else features) * m.d_model
    tokens = cfg.train.batch_size * (cfg.data.seq_len if kind in ("lm", "text") else 1)
    k = getattr(r, "top_k", None) or r.num_experts  # a dense router (SpecDrop) reaches every expert
    per_token = (6 + 2 * k) * hidden + 3 * (k * m.ffn_hidden_size + m.shared_expert_hidden) + r.num_experts
    if kind == "lm":
        per_token += m.heads * cfg.data.seq_len  # attention scores
    return 4 * 4 * weights + 2 * 4 * tokens * moe_layers * per_token  # activations and their gradients


def check_model_fits(cfg, ep_size: int, features: int = 0, classes: int = 0) -> None:
    """Refuse, before any weight is allocated, a model that would not fit in this rank's share of the
    memory available now (the ranks of this machine share it), naming its sizes."""
    needed = training_bytes(cfg, ep_size, features, classes)
    free, local = available_per_rank()
    if needed > free:
        m = cfg.model
        sizes = (f"model.d_model={m.d_model}" + (f" (input features {features})" if features else "")
                 + (f", model.layers={m.layers}, model.heads={m.heads}" if m.kind == "lm" else "")
                 + f", model.ffn_hidden_size={m.ffn_hidden_size}, {cfg.router.num_experts} experts, "
                 + (f"model.shared_expert_hidden={m.shared_expert_hidden}, " if m.shared_expert_hidden else "")
                 + f"train.batch_size={cfg.train.batch_size}" + (f", data.seq_len={cfg.data.seq_len}"
                                                               if m.kind in ("lm", "text") else ""))
        raise ValueError(f"model.kind={m.kind} with {sizes} needs about {needed / 2**30:.3g} GiB per rank to train "
                         f"(weights, gradients, Adam, activations), more than the {free / 2**30:.1f} GiB "
                         f"available{f' to each of {local} ranks here' if local > 1 else ''}")
