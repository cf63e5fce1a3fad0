"""Tiny transformers MoE model folders for the ``model.kind: hf`` tests: a config and, when asked, its
weights and a word-level tokenizer, all made here (nothing downloaded)."""
from __future__ import annotations

from pathlib import Path

import torch

KINDS = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
EXPERTS = 8


def config(kind: str, vocab: int = 300, nodes: int = 2, tied: bool = False, router_loss: bool = True):
    from transformers import DeepseekV3Config, GptOssConfig, MixtralConfig, Qwen3MoeConfig

    common = {"vocab_size": vocab, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
              "num_key_value_heads": 2, "max_position_embeddings": 64, "tie_word_embeddings": tied,
              "initializer_range": 0.2}  # weights large enough that every expert's output shows in the loss
    if kind == "gpt_oss":  # biased, transposed experts with an interleaved, clamped gate; a `router`, not a `gate`
        return GptOssConfig(**common, intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=2,
                            head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"])
    if kind == "mixtral":
        return MixtralConfig(**common, intermediate_size=32, num_local_experts=EXPERTS, num_experts_per_tok=2,
                             output_router_logits=router_loss)
    if kind == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=32, moe_intermediate_size=16, num_experts=EXPERTS,
                              num_experts_per_tok=2, head_dim=16, norm_topk_prob=True)
    # one dense layer, then MoE; routed experts grouped by node, one group per token (the node-limited peer)
    return DeepseekV3Config(**common, intermediate_size=32, moe_intermediate_size=16, n_routed_experts=EXPERTS,
                            num_experts_per_tok=2, n_group=nodes, topk_group=1, n_shared_experts=1,
                            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                            qk_nope_head_dim=8, v_head_dim=8)


def model_folder(folder: Path, kind: str, weights: bool = False, tokenizer_text: str | None = None, **kw) -> Path:
    """``folder`` holding ``kind``'s config (and seed-0 random weights with ``weights``; a word-level tokenizer
    trained on ``tokenizer_text`` when given, the vocabulary sized to it)."""
    from transformers import AutoModelForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab = kw.pop("vocab", 300)
    if tokenizer_text is not None:
        tok = word_tokenizer(tokenizer_text)
        tok.save_pretrained(folder)
        vocab = len(tok)
    cfg = config(kind, vocab, **kw)
    if weights:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    else:
        cfg.save_pretrained(folder)
    return folder


def word_tokenizer(text: str):
    """A whitespace word-level tokenizer over ``text``'s words, with [UNK] and an end-of-text token."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([text], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", eos_token="<eos>")


def text(lines: int = 200) -> str:
    """Deterministic text with some structure to learn."""
    words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "and", "runs", "far", "away"]
    return "".join(" ".join(words[(i * j + j) % len(words)] for j in range(1, 9)) + ".\n" for i in range(lines))
