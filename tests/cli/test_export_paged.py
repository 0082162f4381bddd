"""`export --page-size` from the command line: the paged functions in the manifest, and the
refusals of what cannot be paged (no compile: the compiled functions are tested in
tests/serving/test_engine_paged.py)."""

from __future__ import annotations

import json

from sharktank.export.manifest import Manifest
from test_export_run import sharktank


def test_export_page_size_writes_the_paged_functions(tmp_path):
    out = tmp_path / "art"
    p = sharktank("export", "--model", "toy-llama", "--tp", "2", "--batch-sizes", "1,4", "--max-seq-len", "40", "--page-size", "16",
                  "--functions", "prefill,decode", "--no-compile", "--json", "--output-dir", out)
    transfers = json.loads(p.stdout)["transfers"]
    # --functions chooses among the contiguous kinds; the page size brings the paged ones.
    assert set(transfers) == {"prefill_bs1", "decode_bs1", "prefill_bs4", "decode_bs4", "prefill_paged_bs1", "decode_paged_bs1", "decode_paged_bs4"}
    m = Manifest.read(out)
    assert m.batch_sizes == (1, 4)  # the one-sequence paged prefill adds no batch size
    prefill, decode = m.find("prefill_paged", 1), m.find("decode_paged", 4)
    assert (prefill.page_size, prefill.max_pages, decode.max_pages) == (16, 3, 3)  # ceil(40 / 16)
    assert [a.name for a in decode.inputs] == ["tokens", "positions", "pages"] and decode.inputs[2].shape == (4, 3)
    assert prefill.inputs[2].shape == (1, "Wp")
    # Each block's pool: keys and values split over the 2 devices by KV head, any page count.
    assert {a.shape for a in decode.cache_args} == {("P", 16, 2, 8)} and len(decode.cache_args) == 4 * 2 * 2
    # The decode step's attention and the prompt's read each shard's pool through the table
    # (one dispatch per block and device, no gather; the prompt's table of any width).
    assert {"paged_decode_attention", "paged_prefill_attention"} <= set(m.module["cpu_kernels"])
    mlir = (out / "model.mlir").read_text()
    for name, dispatch in (("decode_paged_bs4", "sharktank_paged_decode_attention_4x4x3x16x2x8_"), ("prefill_paged_bs1", "sharktank_paged_prefill_attention_1x4x16x2x8_")):
        body = _function(mlir, name)
        assert body.count(f"util.call @{dispatch}") == 4 * 2, name
        assert "index_select" not in body, name


def _function(mlir: str, name: str) -> str:
    """The text of function ``name`` of an exported module (to the next function)."""
    start = mlir.index(f"func.func @{name}(")
    end = mlir.find("\n  func.func @", start + 1)
    return mlir[start : end if end != -1 else len(mlir)]


def test_export_page_size_refusals(tmp_path):
    p = sharktank("export", "--model", "toy-llama", "--page-size", "0", "--no-compile", "--output-dir", tmp_path / "a", check=False)
    assert p.returncode == 2 and "--page-size must be a number of positions >= 1, found 0" in p.stderr
    p = sharktank("export", "--model", "toy-llama", "--pp", "2", "--hosts", "2", "--page-size", "4", "--no-compile", "--output-dir", tmp_path / "b", check=False)
    assert p.returncode == 2 and "needs one host and one microbatch path; this plan has 2 hosts" in p.stderr
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
