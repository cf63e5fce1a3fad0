"""train.precision: auto, the default: bf16 where the run's device is a GPU (the grouped GEMMs' fast kernels
are bf16's), fp32 on the CPU and under GAR; fp32 and bf16 as asked."""
from pathlib import Path

import pytest
import torch

from dist_moe.train.config import load_config
from dist_moe.train.layout_choice import moe_shape
from dist_moe.train.precision import run_precision

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)


def test_auto_is_the_default_and_resolves_by_device_and_gar():
    assert load_config(None, []).train.precision == "auto"
    assert run_precision("auto", GPU) == "bf16" and run_precision("auto", CPU) == "fp32"
    assert run_precision("auto", GPU, gar=True) == "fp32"
    for asked in ("fp32", "bf16"):
        assert run_precision(asked, GPU) == run_precision(asked, CPU) == asked


def test_gar_takes_auto_and_fp32_and_refuses_bf16():
    gar = ["router.type=switch", "train.gar.share=0.1"]
    for ok in ("auto", "fp32"):
        assert load_config(None, [*gar, f"train.precision={ok}"]).train.precision == ok
    with pytest.raises(ValueError, match="train.gar trains in fp32 only"):
        load_config(None, [*gar, "train.precision=bf16"])


def test_plan_and_the_layout_choice_price_rows_in_the_precision_the_run_will_train_in():
    cfg = load_config(None, [])
    assert moe_shape(cfg).dtype == "bf16"  # plan prices a GPU cluster
    assert moe_shape(cfg, "cpu").dtype == "fp32"
    assert moe_shape(load_config(None, ["train.precision=fp32"])).dtype == "fp32"
    assert moe_shape(load_config(None, ["parallel.wire_dtype=fp8"])).dtype == "fp8"  # a named wire: its bytes
    assert moe_shape(load_config(None, ["train.precision=fp32", "parallel.wire_dtype=bf16"])).dtype == "bf16"
    mixtral = ["model.kind=hf", f"model.path={Path(__file__).parents[2] / 'examples' / 'hf_mixtral'}",
               "data.name=README.md"]  # a user's transformers model: the same rule
    assert (moe_shape(load_config(None, mixtral)).dtype, moe_shape(load_config(None, mixtral), "cpu").dtype) == (
        "bf16", "fp32")
    assert moe_shape(load_config(None, [*mixtral, "parallel.wire_dtype=fp8"])).dtype == "fp8"


def test_the_runtime_resolves_auto_on_its_device(monkeypatch):
    from dist_moe.train.runtime import Runtime

    cfg = load_config(None, [])
    rt = Runtime(cfg.engine, cfg.parallel, cfg.train.precision)
    try:
        assert rt.device.type == "cpu" and rt.precision == "fp32"
    finally:
        rt.shutdown()
