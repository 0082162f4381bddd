"""One compiled toy-llama for the live-server tests of metrics and auth (batch 2, the byte
tokenizer, the paged functions: the server runs over the page pool, so of the contiguous kinds
only prefill and decode are exported), exported once per test run whichever test or xdist
worker asks first."""

from __future__ import annotations

from pathlib import Path

from reliability.reltools import build_once, shared_dir

BATCH = 2
MAX_SEQ_LEN = 64
PAGE = 8


def _build(out: Path) -> None:
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    export_artifact(load_model("toy-llama"), out, source="toy-llama", batch_sizes=(BATCH,), max_seq_len=MAX_SEQ_LEN, page_size=PAGE,
                    functions=("prefill", "decode"))


def toy_artifact(tmp_path_factory) -> Path:
    """The artifact's directory (its manifest.json is written last: present means built)."""
    return build_once(shared_dir(tmp_path_factory), "serving-toy-bs2-page8", _build)
