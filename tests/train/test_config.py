"""dist_moe/train/config.py and the schema it parses into: a mistyped key is refused with the key it is closest to
beside the keys its section takes, on one line."""
import pytest

from dist_moe.train.config import load_config
from dist_moe.train.run_config import RunConfig


@pytest.mark.parametrize("load,meant", [
    (lambda: load_config(None, ["train.epoch=5"]), "train.epochs"),  # an override, merged against the defaults
    (lambda: RunConfig.from_dict({"train": {"epoch": 5}}), "train.epochs"),  # a mapping, parsed by the schema
    (lambda: load_config(None, ["router.num_expert=8"]), "router.num_experts"),  # a key of the router's type
], ids=["override", "mapping", "router"])
def test_a_mistyped_key_names_the_key_meant(load, meant):
    with pytest.raises(ValueError) as refused:
        load()
    said = str(refused.value)
    assert f"(did you mean {meant!r}?); valid keys" in said and len(said.splitlines()) == 1, said


def test_a_key_like_none_of_them_gets_no_guess():
    with pytest.raises(ValueError, match=r"^unknown config key 'train\.zzz'; valid keys here: \[") as refused:
        load_config(None, ["train.zzz=5"])
    assert "did you mean" not in str(refused.value)
