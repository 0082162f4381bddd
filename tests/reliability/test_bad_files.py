"""Files from elsewhere, fed to ``load_model`` and ``CompiledModel``: damaged, foreign, bit-flipped,
disagreeing with their config, or manifests pointing outside their directory.

Each must give one error of the documented type (``WeightsError`` for weights, ``ArtifactError``
for artifacts) whose message names the file; nothing may be unpickled; no file outside the
source is opened, read or written (Linux inotify sees C/Rust readers too); nothing inside is
written. Format-level damage to a single loader is tested in tests/weights (test_irpa.py,
test_gguf_io.py, test_hf_checkpoint.py, test_sharded_io.py) and broken artifacts through the
CLI in tests/cli/test_export_run.py; here the same kinds of damage go through the model-level
entry points, with the guards above.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch

from guards import Watch, inotify_available, no_pickle, tree_state
from sharktank.models import load_model, save_gguf, save_model_irpa, save_theta
from sharktank.models.llama.config import LlamaConfig
from sharktank.models.llama.presets import random_theta
from sharktank.runtime import ArtifactError, CompiledModel
from sharktank.types import SplitPrimitiveTensor
from sharktank.weights import Theta, WeightsError

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=32)
TOKENS = torch.tensor([[1, 2, 3, 4]])
HF_CONFIG = dict(
    model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-5, rope_theta=10000.0,
)
needs_inotify = pytest.mark.skipif(not inotify_available(), reason="needs Linux inotify to watch file accesses")


def _write_sources(root: Path, config: LlamaConfig = CONFIG, theta: Theta | None = None) -> dict[str, Path]:
    """The same weights as .irpa, .gguf, a Hugging Face directory and a sharded theta directory."""
    from safetensors.torch import save_file

    theta = theta if theta is not None else random_theta(CONFIG)
    save_model_irpa(root / "m.irpa", config, theta)
    save_gguf(root / "m.gguf", CONFIG, theta)
    (root / "hf").mkdir()
    save_file({k: v.contiguous() for k, v in theta.items()}, root / "hf" / "model.safetensors")
    (root / "hf" / "config.json").write_text(json.dumps({**HF_CONFIG, "intermediate_size": config.intermediate_size}))
    split = theta.map(lambda _, t: SplitPrimitiveTensor(shard_dim=0, ts=t, devices=(3, 5), pinned=True) if t.ndim == 2 else t)
    save_theta(root / "theta", config, split)
    return {"irpa": root / "m.irpa", "gguf": root / "m.gguf", "safetensors": root / "hf", "theta": root / "theta"}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    _write_sources(root)
    return root


@pytest.fixture
def sandbox(pristine, tmp_path):
    """A copy of the sources in ``src/`` and decoys in ``outside/`` that a loader must not touch."""
    shutil.copytree(pristine, tmp_path / "src")
    out = tmp_path / "outside"
    out.mkdir()
    # Decoys that would load if reached: the real archives under the names a bad manifest uses.
    shutil.copy(pristine / "theta" / "device_3.irpa", out / "x.irpa")
    shutil.copy(pristine / "m.irpa", out / "m.irpa")
    (out / "secret.mlir").write_text("module {}\n")
    return tmp_path


def _source(sandbox: Path, kind: str) -> Path:
    return {
        "irpa": sandbox / "src" / "m.irpa", "gguf": sandbox / "src" / "m.gguf",
        "safetensors": sandbox / "src" / "hf", "theta": sandbox / "src" / "theta",
    }[kind]


def _file(sandbox: Path, kind: str) -> Path:
    """The file whose bytes a damage case changes."""
    src = _source(sandbox, kind)
    return {"safetensors": src / "model.safetensors", "theta": src / "device_3.irpa"}.get(kind, src)


def expect_clear_error(sandbox: Path, load, names: Path | str, error=WeightsError, figure=None, case: str = "") -> str:
    """``load()`` raises ``error`` naming ``names``, unpickles nothing, touches nothing outside
    ``src/`` and writes nothing inside it. Returns the message."""
    before = tree_state(sandbox)
    watch = Watch(sandbox / "outside", *sorted((sandbox / "outside").iterdir())) if inotify_available() else None
    try:
        with no_pickle() as pickles:
            with pytest.raises(error) as err:
                load()
        events = watch.events() if watch else []
    finally:
        if watch:
            watch.close()
    msg = str(err.value)
    assert str(names) in msg or Path(str(names)).name in msg, f"the error does not name {names}: {msg}"
    assert "\n" not in msg.strip(), f"not one line: {msg}"
    assert not pickles, f"unpickling attempted: {pickles}"
    assert not events, f"touched outside the source: {events}"
    assert tree_state(sandbox) == before, "loading changed files"
    if figure is not None:
        figure("bad input", f"{case}: {type(err.value).__name__}: {_excerpt(msg, sandbox)}")
    return msg


def _excerpt(msg: str, sandbox: Path) -> str:
    msg = msg.replace(str(sandbox), "TMP")
    return msg if len(msg) <= 150 else msg[:147] + "..."


def test_pristine_sources_load_and_agree(pristine):
    sources = [pristine / "m.irpa", pristine / "m.gguf", pristine / "hf", pristine / "theta"]
    logits = [load_model(p).prefill(TOKENS) for p in sources]
    for x in logits[1:]:
        assert (x - logits[0]).abs().max().item() <= 1e-5


# --- damaged files -------------------------------------------------------------------------------

DAMAGE = {
    "truncated": lambda b: b[: len(b) // 2],
    "truncated in the header": lambda b: b[:20],
    "zero-length": lambda b: b"",
    "wrong magic": lambda b: b"XXXX" + b[4:],
    "a pickle (torch.save) under this name": None,
    "another format under this name": None,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("kind", ["irpa", "gguf", "safetensors", "theta"])
def test_damaged_file_gives_one_clear_error(sandbox, kind, damage, figure):
    file = _file(sandbox, kind)
    data = file.read_bytes()
    if damage.startswith("a pickle"):
        torch.save({"model.embed_tokens.weight": torch.zeros(3)}, file)
    elif damage.startswith("another format"):
        other = sandbox / "src" / ("m.gguf" if kind != "gguf" else "m.irpa")
        file.write_bytes(other.read_bytes())
    else:
        file.write_bytes(DAMAGE[damage](data))
    expect_clear_error(sandbox, lambda: load_model(_source(sandbox, kind)), file.name, figure=figure, case=f"{kind}: {damage}")


@pytest.mark.parametrize("kind", ["irpa", "gguf", "safetensors", "theta"])
def test_bit_flips_are_refused_or_load_never_crash(sandbox, kind, figure):
    """One flipped bit at seeded positions (dense over the header, sparse over the data).

    The three single-file formats carry no checksum: a flip in tensor data (or in a number such
    as rms_norm_eps) loads as different weights, and nothing can tell. Flips that break the
    structure must be a WeightsError naming the file, never another exception, a hang or a
    memory blow-up. Theta directories carry sha256 per archive: every flip is refused."""
    file = _file(sandbox, kind)
    data = file.read_bytes()
    rng = random.Random(f"flip-{kind}")
    header = min(len(data), 640)
    positions = list(range(0, header, 5)) + [rng.randrange(header, len(data)) for _ in range(24)]
    outcomes = {"refused": 0, "loaded": 0}
    with no_pickle() as pickles:
        for pos in positions:
            flipped = bytearray(data)
            flipped[pos] ^= 1 << rng.randrange(8)
            file.write_bytes(bytes(flipped))
            try:
                load_model(_source(sandbox, kind))
                outcomes["loaded"] += 1
                assert kind != "theta", f"theta directory loaded with byte {pos} flipped"
            except WeightsError as e:
                assert file.name in str(e), f"flip at {pos}: error does not name {file.name}: {e}"
                outcomes["refused"] += 1
            # Anything else propagates and fails the test with the offset in the traceback.
    assert not pickles, f"unpickling attempted: {pickles}"
    file.write_bytes(data)
    figure("bad input", f"{kind}: {len(positions)} single-bit flips: {outcomes['refused']} refused (WeightsError naming "
                        f"{file.name}), {outcomes['loaded']} loaded (flip in data/unchecked fields; the format has no checksum)"
                        if kind != "theta" else f"theta dir: {len(positions)} single-bit flips in {file.name}: all refused (sha256)")
    assert outcomes["refused"] >= len(positions) // 3


# --- checkpoints whose shapes disagree with their config ------------------------------------------


def test_hf_config_disagreeing_with_tensors(sandbox, figure):
    cfg = sandbox / "src" / "hf" / "config.json"
    cfg.write_text(json.dumps({**HF_CONFIG, "intermediate_size": 40}))
    msg = expect_clear_error(sandbox, lambda: load_model(sandbox / "src" / "hf"), "model.safetensors", figure=figure,
                             case="safetensors: config.json intermediate_size 40, tensors 48")
    assert "[40, 32]" in msg


def test_hf_tensor_with_a_wrong_shape(sandbox, figure):
    from safetensors.torch import load_file, save_file

    f = sandbox / "src" / "hf" / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.1.mlp.down_proj.weight"] = torch.zeros(32, 40)
    save_file(tensors, f)
    msg = expect_clear_error(sandbox, lambda: load_model(sandbox / "src" / "hf"), "model.safetensors", figure=figure,
                             case="safetensors: down_proj [32, 40], config implies [32, 48]")
    assert "model.layers.1.mlp.down_proj.weight" in msg


def test_theta_manifest_shape_disagreeing_with_its_shards(sandbox, figure):
    m = sandbox / "src" / "theta" / "theta.json"
    manifest = json.loads(m.read_text())
    manifest["tensors"]["model.norm.weight"]["shape"] = [31]
    m.write_text(json.dumps(manifest))
    expect_clear_error(sandbox, lambda: load_model(sandbox / "src" / "theta"), "theta.json", figure=figure,
                       case="theta dir: manifest shape [31] for a [32] tensor")


# load_weights checks .irpa archives and theta directories against the config too.
@pytest.mark.parametrize("kind", ["irpa", "theta"])
def test_config_disagreeing_with_tensors_irpa_and_theta(tmp_path, kind):
    # Before load_weights checked these layouts, this loaded silently and ran with the tensors'
    # own shapes (found by this suite; a flipped byte in a tensor name gave a KeyError).
    bad = dataclasses.replace(CONFIG, intermediate_size=40)
    sources = _write_sources(tmp_path, bad, random_theta(CONFIG))
    with pytest.raises(WeightsError) as err:
        load_model(sources[kind])
    # An MLP weight, [intermediate, hidden] or its transpose, as stored and as the config implies.
    h, i, j = CONFIG.hidden_size, CONFIG.intermediate_size, bad.intermediate_size
    shapes = rf"shape \[({i}, {h}|{h}, {i})\] disagrees with the config, which implies \[({j}, {h}|{h}, {j})\]"
    assert re.search(rf"'model\.layers\.\d+\.mlp\.\w+_proj\.weight': {shapes}", str(err.value)), err.value
    assert str(sources[kind]) in str(err.value), err.value


@pytest.mark.parametrize("kind", ["irpa", "theta"])
def test_missing_tensor_irpa_and_theta(tmp_path, kind):
    theta = Theta({k: v for k, v in random_theta(CONFIG).items() if k != "model.norm.weight"})
    src = tmp_path / ("model.irpa" if kind == "irpa" else "theta")
    if kind == "irpa":
        save_model_irpa(src, CONFIG, theta)
    else:
        save_theta(src, CONFIG, theta)
    with pytest.raises(WeightsError) as err:
        load_model(src)
    assert "model.norm.weight" in str(err.value)


# --- manifests that point outside their directory -------------------------------------------------


def _edit_json(path: Path, edit) -> None:
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(m))


@needs_inotify
@pytest.mark.parametrize(
    "case, edit",
    [
        ("archive ../outside/x.irpa", lambda m: m["archives"].update({"../outside/x.irpa": m["archives"]["device_3.irpa"]})),
        ("archive absolute path", lambda m: m["archives"].update({"/outside/x.irpa": m["archives"]["device_3.irpa"]})),
        ("shard file ../outside/x.irpa", lambda m: m["tensors"]["model.layers.0.self_attn.q_proj.weight"]["shards"][0].update(file="../outside/x.irpa")),
        ("names a missing archive", lambda m: m["archives"].update({"device_9.irpa": m["archives"]["device_3.irpa"]})),
    ],
)
def test_theta_manifest_pointing_outside_or_missing(sandbox, case, edit, figure):
    theta = sandbox / "src" / "theta"
    if "absolute" in case:
        edit = lambda m: m["archives"].update({str(sandbox / "outside" / "x.irpa"): m["archives"]["device_3.irpa"]})  # noqa: E731
    _edit_json(theta / "theta.json", edit)
    names = "device_9.irpa" if "missing" in case else "theta.json"
    expect_clear_error(sandbox, lambda: load_model(theta), names, figure=figure, case=f"theta dir: manifest {case}")


@needs_inotify
def test_theta_symlink_leading_outside(sandbox, figure):
    f = sandbox / "src" / "theta" / "device_3.irpa"
    f.unlink()
    f.symlink_to(sandbox / "outside" / "x.irpa")
    msg = expect_clear_error(sandbox, lambda: load_model(sandbox / "src" / "theta"), "theta.json", figure=figure,
                             case="theta dir: device_3.irpa is a symlink to outside")
    assert "outside" in msg


@needs_inotify
def test_hf_index_pointing_outside(sandbox, figure):
    hf = sandbox / "src" / "hf"
    shutil.copy(hf / "model.safetensors", sandbox / "outside" / "w.safetensors")
    (hf / "model.safetensors").rename(hf / "model-00001-of-00001.safetensors")
    from safetensors import safe_open

    with safe_open(str(hf / "model-00001-of-00001.safetensors"), "pt") as f:
        names = list(f.keys())
    weight_map = {n: "model-00001-of-00001.safetensors" for n in names}
    weight_map["model.norm.weight"] = "../outside/w.safetensors"
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    expect_clear_error(sandbox, lambda: load_model(hf), "model.safetensors.index.json", figure=figure,
                       case="safetensors: index maps a tensor to ../outside/w.safetensors")


# --- artifacts -------------------------------------------------------------------------------------


@pytest.fixture
def artifact(toy_artifact, sandbox):
    d = sandbox / "src" / "art"
    shutil.copytree(toy_artifact, d)
    shutil.copy(toy_artifact / "model.vmfb", sandbox / "outside" / "model.vmfb")
    return d


ARTIFACT_CASES = [
    ("parameter file ../outside/x.irpa", lambda m: m["parameters"]["files"].update({"../outside/x.irpa": {"device": 0, "size": 1, "sha256": "0"}}), "x.irpa"),
    ("module.vmfb ../outside/model.vmfb", lambda m: m["module"].update(vmfb="../outside/model.vmfb"), "model.vmfb"),
    ("module.mlir ../outside/secret.mlir", lambda m: m["module"].update(mlir="../outside/secret.mlir"), "secret.mlir"),
    ("module.vmfb absolute path", None, "model.vmfb"),
    ("names a missing archive", lambda m: m["parameters"]["files"].update({"device_7.irpa": {"device": 0, "size": 1, "sha256": "0"}}), "device_7.irpa"),
    ("sha256 of device_0.irpa differs", lambda m: m["parameters"]["files"]["device_0.irpa"].update(sha256="0" * 64), "device_0.irpa"),
    ("field 'versions' missing", lambda m: m.pop("versions"), "manifest.json"),
    ("device_count 0", lambda m: m.update(device_count=0), "manifest.json"),
    # The module still asks for the scope it was exported with; no archive provides it now.
    ("parameter scope renamed", lambda m: m["parameters"].update(scope="other"), "no provider registered that handles scopes like '{scope}'"),
    ("not JSON", "{", "manifest.json"),
]


@needs_inotify
@pytest.mark.parametrize("case, edit, names", ARTIFACT_CASES, ids=[c[0] for c in ARTIFACT_CASES])
def test_artifact_manifest_pointing_outside_or_inconsistent(artifact, sandbox, case, edit, names, figure):
    from sharktank.export.artifact import compile_artifact

    manifest = artifact / "manifest.json"
    names = names.format(scope=json.loads(manifest.read_text())["parameters"]["scope"])
    if edit == "{":
        manifest.write_text("{")
    elif edit is None:
        _edit_json(manifest, lambda m: m["module"].update(vmfb=str(sandbox / "outside" / "model.vmfb")))
    else:
        _edit_json(manifest, edit)
    load = (lambda: compile_artifact(artifact)) if "mlir" in case else (lambda: CompiledModel(artifact))
    expect_clear_error(sandbox, load, names, error=ArtifactError, figure=figure, case=f"artifact: manifest {case}")


@needs_inotify
def test_artifact_symlink_leading_outside(artifact, sandbox, figure):
    (artifact / "model.vmfb").unlink()
    (artifact / "model.vmfb").symlink_to(sandbox / "outside" / "model.vmfb")
    msg = expect_clear_error(sandbox, lambda: CompiledModel(artifact), "model.vmfb", error=ArtifactError, figure=figure,
                             case="artifact: model.vmfb is a symlink to outside")
    assert "outside" in msg


def test_artifact_bit_flips_are_all_refused(artifact, figure):
    rng = random.Random("artifact-flips")
    n = 0
    for name in ("device_0.irpa", "model.vmfb"):
        f = artifact / name
        data = f.read_bytes()
        for _ in range(6):
            flipped = bytearray(data)
            pos = rng.randrange(len(data))
            flipped[pos] ^= 1 << rng.randrange(8)
            f.write_bytes(bytes(flipped))
            with pytest.raises(ArtifactError, match=f"{name}: sha256 does not match"):
                CompiledModel(artifact)
            n += 1
        f.write_bytes(data)
    figure("bad input", f"artifact: {n} single-bit flips in device_0.irpa / model.vmfb: all refused (sha256 does not match)")
    CompiledModel(artifact)  # restored: loads again


# --- regressions: GGUF damage that escaped as other errors (fixed in sharktank/weights) -------------


def _gguf_value_offset(data: bytes, key: str) -> int:
    """Offset of the value of a GGUF metadata key (after its name and 4-byte type)."""
    return data.index(key.encode()) + len(key) + 4


def test_gguf_block_count_flip_is_refused_quickly(sandbox):
    # One flipped bit (2**26) in block_count: building the names of 67 million layers took ~50 s
    # and every byte of memory (the OOM killer ended the process) before the check said "missing".
    import time

    f = _file(sandbox, "gguf")
    data = bytearray(f.read_bytes())
    data[_gguf_value_offset(bytes(data), "llama.block_count") + 3] ^= 1 << 2
    f.write_bytes(bytes(data))
    t0 = time.monotonic()
    with pytest.raises(WeightsError, match=r"m\.gguf.*missing \(the config has 67108866 layers\)"):
        load_model(f)
    assert time.monotonic() - t0 < 10


def test_gguf_string_with_a_flipped_bit_is_a_weights_error(sandbox):
    # 'llama' -> 'l\xecama': the reader decodes strings lazily, so UnicodeDecodeError escaped.
    f = _file(sandbox, "gguf")
    data = bytearray(f.read_bytes())
    data[_gguf_value_offset(bytes(data), "general.architecture") + 8 + 1] ^= 0x80
    f.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match=r"m\.gguf: not a readable GGUF file: UnicodeDecodeError"):
        load_model(f)
