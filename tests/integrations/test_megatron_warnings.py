"""What dist-moe's Megatron hosts leave unsaid: Megatron's import notes on Apex and Transformer Engine, which cannot
run on the CPU (a GPU run keeps them), and the deprecation of its own default cuda_graph_scope in a config dist-moe
builds."""
import re
import warnings

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install 'dist-moe[megatron]')")

# Megatron 0.16.1's own words, from its optimizer, its layer specs and its multi-latent attention
IMPORT_NOTES = [("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning),
                ("Apex is not installed. Falling back to Torch Norm", UserWarning),
                ("The 'megatron.core.transformer.custom_layers.transformer_engine' \n    module is deprecated and will "
                 "be removed in 0.10.0.", DeprecationWarning)]
OTHER = ("a note of another kind", UserWarning)


def _said(run) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in seen]


def test_megatrons_import_notes_are_dropped_on_the_cpu_and_kept_on_a_gpu(monkeypatch):
    from dist_moe.integrations.megatron import patches

    monkeypatch.setattr(patches, "_APPLIED", False)  # the notes come with Megatron's first import
    monkeypatch.setattr(patches, "_NOTING_MODULES", ())

    def importing(cpu):
        def run():
            with patches._without_import_notes(cpu):
                for note, kind in [*IMPORT_NOTES, OTHER]:
                    warnings.warn(note, kind, stacklevel=1)
        return run

    assert _said(importing(cpu=True)) == [OTHER[0]]
    assert _said(importing(cpu=False)) == [note for note, _ in [*IMPORT_NOTES, OTHER]]


def test_megatron_config_says_nothing_of_the_default_scope_it_did_not_choose():
    from dist_moe.integrations.megatron import hosts, megatron_config

    said = _said(lambda: megatron_config(8, 16, 4, 2))
    assert not [m for m in said if re.search(hosts.DEFAULT_SCOPE_NOTE, m)], said
    chosen = _said(lambda: megatron_config(8, 16, 4, 2, cuda_graph_scope="full"))  # a caller's choice: its note kept
    assert [m for m in chosen if re.search(hosts.DEFAULT_SCOPE_NOTE, m)], chosen
