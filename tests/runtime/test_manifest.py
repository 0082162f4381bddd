"""The typed artifact contract (sharktank.export.manifest): what export writes reads back into
FunctionSpecs by kind and batch, and a manifest that breaks the contract is refused with the
field named, before any reader indexes into it."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from sharktank.export.manifest import (
    ArtifactError, HostsManifest, Manifest, function_name, parse_function_name, read_any,
)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """toy-llama at tp 2, batch sizes 1 and 2, written without compiling (the MLIR and archives only)."""
    from sharktank.export.artifact import export_artifact
    from sharktank.models import load_model

    out = tmp_path_factory.mktemp("manifest") / "art"
    returned = export_artifact(load_model("toy-llama", tp=2), out, source="toy-llama", batch_sizes=(1, 2), max_seq_len=16, compile=False)
    return out, returned


def test_names_round_trip_and_unknown_kinds_are_refused():
    for kind in ("prefill", "decode", "prefill_row", "prefill_rows"):
        assert parse_function_name(function_name(kind, 4)) == (kind, 4)
    with pytest.raises(ValueError, match="kind must be one of"):
        function_name("train", 1)
    for bad in ("decode", "decode_bs0", "train_bs1", "decode_bs1x"):
        with pytest.raises(ArtifactError, match="expected KIND_bsB"):
            parse_function_name(bad)


def test_what_export_writes_reads_back_typed(written):
    out, returned = written
    m = Manifest.read(out)
    assert isinstance(returned, Manifest) and returned.data == m.data  # export returns what it wrote, read back
    assert m.data == json.loads((out / "manifest.json").read_text())
    assert sorted(m.functions) == ["decode_bs1", "decode_bs2", "prefill_bs1", "prefill_bs2", "prefill_chunk_bs1", "prefill_chunk_bs2", "prefill_row_bs2", "prefill_rows_bs2"]
    assert m.batch_sizes == (1, 2) and m.max_seq_len == 16 and m.device_count == 2 and m.dtype == "float32"
    assert m.find("prefill_row", 1) is None and m.find("train", 1) is None  # batch 1 needs no row function
    row = m.find("prefill_row", 2)
    assert (row.kind, row.batch_size, row.max_seq_len) == ("prefill_row", 2, 16)
    assert [a.name for a in row.inputs] == ["tokens", "positions", "row", "keep"]
    assert row.inputs[3].shape == (1, "K")  # the positions whose logits it returns
    assert [a.name for a in row.cache_args] == [f"cache.{i}" for i in range(len(row.cache_args))]
    assert m.smallest("decode").name == "decode_bs1"
    # The cache arrays are split by KV heads over both devices.
    assert {a.device for a in row.cache_args} == {0, 1} and all(a.shape[0] == 2 and a.shape[1] == 16 for a in row.cache_args)
    assert isinstance(read_any(out), Manifest)


def _refused(out, tmp_path, edit, match):
    data = copy.deepcopy(json.loads((out / "manifest.json").read_text()))
    edit(data)
    with pytest.raises(ArtifactError, match=match):
        Manifest.from_dict(data, out)


def test_a_manifest_that_breaks_the_contract_is_refused_by_field(written, tmp_path):
    out, _ = written
    _refused(out, tmp_path, lambda d: d["functions"]["decode_bs2"].update(batch_size=4), r"functions.decode_bs2.batch_size must be 2, found 4")
    _refused(out, tmp_path, lambda d: d["functions"]["decode_bs1"]["cache"].pop("max_seq_len"), r"decode_bs1.cache.max_seq_len must be a positive integer, found None")
    _refused(out, tmp_path, lambda d: d["functions"]["prefill_bs1"]["args"][0].pop("device"), r"prefill_bs1.args\[0\] must have name, shape, dtype and an integer device")
    _refused(out, tmp_path, lambda d: d["functions"].update(warmup_bs1=d["functions"]["decode_bs1"]), r"'warmup_bs1': expected KIND_bsB")
    _refused(out, tmp_path, lambda d: d["functions"].clear(), "exports no functions")
    _refused(out, tmp_path, lambda d: d.update(device_count=True), "'device_count' is missing or not int")
    _refused(out, tmp_path, lambda d: d["module"].update(mlir="../elsewhere.mlir"), r"\.\.")
    _refused(out, tmp_path, lambda d: d.update(format="sharktank.theta"), "not a sharktank artifact manifest")


def test_a_hosts_manifest_is_its_own_type(written, tmp_path):
    out, _ = written
    with pytest.raises(ArtifactError, match="not a multi-host artifact"):
        HostsManifest.read(out)
    hosts = {"format": "sharktank.hosts", "hosts": [{"host": 0, "dir": "host_0", "manifest_sha256": "0"}, {"host": 1, "dir": "host_1", "manifest_sha256": "1"}],
             "model": {"dtype": "float32", "config": {"vocab_size": 7}}, "boundary": {"hidden_size": 5}}
    (tmp_path / "manifest.json").write_text(json.dumps(hosts))
    m = read_any(tmp_path)
    assert isinstance(m, HostsManifest) and m.host_dir(1) == tmp_path / "host_1" and (m.vocab_size, m.hidden_size) == (7, 5)
    with pytest.raises(ArtifactError, match="multi-host artifact \\(2 hosts\\); run it on every host"):
        Manifest.read(tmp_path)
    hosts["hosts"][1]["dir"] = "/abs"
    (tmp_path / "manifest.json").write_text(json.dumps(hosts))
    with pytest.raises(ArtifactError):
        HostsManifest.read(tmp_path)


def test_a_multi_host_pipeline_refuses_a_prefill_rows_call_clearly():
    """The latent bug: DistributedModel.forward took no ``lengths``, so a prefill_rows call
    raised a TypeError from inside the runtime. It is refused by name before anything is sent."""
    from sharktank.runtime.compiled import InputError
    from sharktank.runtime.distributed import DistributedModel

    model = object.__new__(DistributedModel)  # no ranks needed: the refusal comes first
    tokens = torch.zeros(2, 3, dtype=torch.int64)
    with pytest.raises(InputError, match="runs prefill, decode, prefill_row calls, not prefill_rows with lengths"):
        model.forward("prefill_rows", tokens, tokens, [], lengths=[3, 3])
