"""The compiled toy-llama of the engine tests (test_engine.py, test_engine_paged.py): batch
sizes 1 and 4, a cache of ``T`` positions and the paged functions with pages of ``PAGE``,
exported once per test run whichever test or xdist worker asks first."""

from __future__ import annotations

from pathlib import Path

from reliability.reltools import build_once, shared_dir

T = 32  # cache length
PAGE = 4  # positions per KV-cache page of the paged functions


def _build(out: Path) -> None:
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    export_artifact(load_model("toy-llama"), out, source="toy-llama", batch_sizes=(1, 4), max_seq_len=T, page_size=PAGE)


def engine_artifact(tmp_path_factory) -> Path:
    """The artifact's directory (its manifest.json is written last: present means built)."""
    return build_once(shared_dir(tmp_path_factory), f"engine-toy-bs1-4-T{T}-page{PAGE}", _build)
