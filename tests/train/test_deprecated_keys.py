"""The deprecated config keys say in which release they stop being read, a release still ahead: once
dist_moe's version reaches it, this fails until they are removed."""
import re
from pathlib import Path

import pytest
from packaging.version import Version

from dist_moe import __version__
from dist_moe.config.choices import DEPRECATED_KEYS_REMOVED_IN
from dist_moe.train.config import load_config

ROOT = Path(__file__).resolve().parents[2]
SAYS = rf"refused from release {re.escape(DEPRECATED_KEYS_REMOVED_IN)}"


def test_the_release_that_removes_them_is_still_ahead():
    assert Version(__version__) < Version(DEPRECATED_KEYS_REMOVED_IN), \
        f"release {__version__}: remove parallel.megatron_dispatcher, parallel.deepspeed_dispatcher and router.gar"


@pytest.mark.parametrize("overrides", [
    ["engine=megatron", "model.capacity_factor=null", "parallel.megatron_dispatcher=allgather"],
    ["engine=deepspeed", "model.capacity_factor=null", "parallel.deepspeed_dispatcher=dist_moe"],
    ["parallel.megatron_dispatcher=alltoall"],  # another engine's key: it never applied
    ["router={type: switch, num_experts: 8, top_k: 2, gar: {lambda: 0.01}}"],
])
def test_each_warning_names_that_release(overrides):
    with pytest.warns(FutureWarning, match=SAYS):
        load_config(None, overrides)


def test_the_pages_name_it_too():
    release = f"release {DEPRECATED_KEYS_REMOVED_IN}"
    assert release in (ROOT / "docs" / "engines.md").read_text()  # the dispatcher keys
    assert release in (ROOT / "docs" / "getting-started.md").read_text()  # router.gar
    assert f"{DEPRECATED_KEYS_REMOVED_IN}" in (ROOT / "CHANGELOG.md").read_text()
