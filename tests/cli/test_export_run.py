"""The command line end to end: export (recipes), compile, run against eager, inspect; and the
errors a user gets from broken or foreign artifacts."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def sharktank(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "sharktank.cli", *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    if check and p.returncode != 0:
        raise AssertionError(f"sharktank {' '.join(map(str, args))} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p


@pytest.fixture(scope="module")
def tp2pp2(tmp_path_factory):
    out = tmp_path_factory.mktemp("art") / "tp2pp2"
    p = sharktank("export", "--recipe", ROOT / "exports" / "toy-llama-tp2-pp2.toml", "--output-dir", out, "--json")
    return out, json.loads(p.stdout)


def test_export_summary_and_manifest(tp2pp2):
    out, summary = tp2pp2
    # Per function: 4 blocks x 2 all_reduces x 2 transfers (two devices swap shards), 1 stage
    # boundary x 2 shards, 1 LM-head gather, and the inputs from device 0: tokens to 1,
    # positions to 1, 2 and 3.
    # prefill_chunk also sends the row index from device 0 to the 3 others, and each prefill
    # its kept positions (whose logits it returns) to the last stage's devices 2 and 3.
    assert summary["transfers"] == {"prefill_bs1": 23 + 2, "decode_bs1": 23, "prefill_chunk_bs1": 23 + 3 + 2}
    assert summary["device_count"] == 4 and summary["module_bytes"] > 0 and summary["compile_seconds"] > 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["parallel"]["tp"] == 2 and manifest["parallel"]["pp"] == 2
    assert set(manifest["parameters"]["files"]) == {f"device_{d}.irpa" for d in range(4)}
    for key in ("torch", "iree-turbine", "iree-base-compiler", "iree-base-runtime"):
        assert manifest["versions"][key] != "unknown"
    assert "--iree-hal-target-device=local[3]" in manifest["compile"]["flags"]
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp dirs left


def test_each_device_loads_only_its_own_shards(tp2pp2):
    out, _ = tp2pp2
    mlir = (out / "model.mlir").read_text()
    globals_ = re.findall(r'util\.global private @\S+ \{stream\.affinity = #hal\.device\.promise<@__device_(\d)>\} = #flow\.parameter\.named<"model"::"([^"]+)">', mlir)
    assert len(globals_) > 50
    for device, name in globals_:
        assert name.endswith(f"@d{device}"), (device, name)
    from sharktank.weights import irpa_keys

    for d in range(4):
        keys = irpa_keys(out / f"device_{d}.irpa")
        assert keys and all(k.endswith(f"@d{d}") for k in keys)
    assert {n for _, n in globals_} == {k for d in range(4) for k in irpa_keys(out / f"device_{d}.irpa")}


def test_run_matches_eager(tp2pp2):
    out, _ = tp2pp2
    p = sharktank("run", out, "--tokens", "1,2,3,4,5", "--max-new-tokens", "6", "--compare-eager", "--json")
    r = json.loads(p.stdout)
    assert len(r["ids"]) == 6 and r["eager_ids_match"]
    assert r["max_abs_error_vs_eager"] <= 1e-4
    assert r["device_count"] == 4 and r["dtype"] == "float32" and r["decode_ms_per_token"]["median"] > 0
    # The first token comes after the interpreter started, imported and loaded the module,
    # and prefilled: later than the load alone plus the prefill.
    assert 0 < r["load_s"] and r["load_s"] + r["prefill_ms"] / 1e3 < r["first_token_s"] < 120


def test_local_sync_driver_gives_the_same_logits(tp2pp2, tmp_path):
    import numpy as np

    out, _ = tp2pp2
    logits = {}
    for driver in ("local-task", "local-sync"):
        p = sharktank("run", out, "--tokens", "3,1,4", "--max-new-tokens", "4", "--driver", driver, "--save-logits", tmp_path / f"{driver}.npy", "--json")
        assert json.loads(p.stdout)["driver"] == driver
        logits[driver] = np.load(tmp_path / f"{driver}.npy")
    # The same kernels in the same order: only the threads that run them differ.
    np.testing.assert_array_equal(logits["local-task"], logits["local-sync"])
    p = sharktank("run", out, "--tokens", "3", "--driver", "cuda", check=False)
    assert p.returncode == 2 and "compiled for cpu, which runs on driver local-task or local-sync, not 'cuda'" in p.stderr, p.stderr


def test_save_logits_and_inspect(tp2pp2, tmp_path):
    import numpy as np

    out, _ = tp2pp2
    sharktank("run", out, "--tokens", "7,8", "--max-new-tokens", "3", "--save-logits", tmp_path / "l.npy")
    logits = np.load(tmp_path / "l.npy")
    assert logits.shape == (1, 3, 256)
    info = json.loads(sharktank("inspect", out, "--json").stdout)
    assert info["stages"][1]["devices"] == [[2, 3]] and info["transfers"]["decode_bs1"] == 23
    assert set(info["parameter_bytes_per_device"]) == {"0", "1", "2", "3"}
    text = sharktank("inspect", out, "--svg", tmp_path / "plan.svg").stdout
    # The drawing: stage 1 (blocks 2-3) runs path A on devices 2 and 3 only.
    first, row = (next(line for line in text.splitlines() if line.startswith(f"stage {s}")) for s in (0, 1))
    assert row.split() == ["stage", "1", "A", "A", "blocks", "2-3"] and row.index("A") > first.rindex("A")
    assert "path A: dev 0+1 -> dev 2+3" in text
    assert (tmp_path / "plan.svg").read_text().startswith("<svg") and "path A: devices 0+1 -&gt; 2+3" in (tmp_path / "plan.svg").read_text()


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def _edit_manifest(d: Path, fn) -> None:
    m = json.loads((d / "manifest.json").read_text())
    fn(m)
    (d / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda d: (d / "device_2.irpa").write_bytes((d / "device_2.irpa").read_bytes()[:-64] + b"x" * 64), "device_2.irpa: sha256 does not match"),
        (lambda d: (d / "device_1.irpa").unlink(), "device_1.irpa: missing"),
        (lambda d: _edit_manifest(d, lambda m: m["parameters"]["files"].update({"../x.irpa": {"device": 0, "size": 1, "sha256": "0"}})), "x.irpa"),
        (lambda d: _edit_manifest(d, lambda m: m["versions"].update({"iree-base-compiler": "3.13.0"})), "built by iree-base-compiler 3.13.0"),
        (lambda d: _edit_manifest(d, lambda m: m["compile"].update({"host_cpu": "x86_64 Other CPU [000000000000]"})), "compiled for host CPU x86_64 Other CPU"),
        (lambda d: _edit_manifest(d, lambda m: m.update({"format": "zip"})), "not a sharktank artifact"),
        (lambda d: (d / "manifest.json").write_text("{"), "not valid JSON"),
    ],
)
def test_broken_artifacts_give_one_clear_error(tp2pp2, tmp_path, breakage, message):
    d = _copy(tp2pp2[0], tmp_path)
    breakage(d)
    p = sharktank("run", d, "--tokens", "1,2", check=False)
    assert p.returncode == 2 and message in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_runtime_misuse(tp2pp2):
    out, _ = tp2pp2
    for args, message in [
        (["--tokens", "1,2;3,4"], "no prefill function for batch size 2; exported batch sizes: [1]"),
        (["--tokens", "1,999"], "token ids must be in [0, 256)"),
        (["--tokens", "1,2", "--max-new-tokens", "70"], "past the exported cache length 64"),
        (["--tokens", "1,x"], "must be comma-separated integers"),
    ]:
        p = sharktank("run", out, *args, check=False)
        assert p.returncode == 2 and message in p.stderr, p.stderr


def test_failed_export_keeps_the_previous_output(tp2pp2, tmp_path):
    d = _copy(tp2pp2[0], tmp_path)
    before = (d / "manifest.json").read_text()
    p = sharktank("export", "--model", "toy-llama", "--tp", "3", "--output-dir", d, check=False)
    assert p.returncode == 2 and "tp=3 must divide" in p.stderr
    # prefill and decode only: the bad flag fails the compile of any program.
    p = sharktank("export", "--model", "toy-llama", "--max-seq-len", "16", "--functions", "prefill,decode", "--compile-flag=--no-such-flag",
                  "--output-dir", d, check=False)
    assert p.returncode != 0
    assert (d / "manifest.json").read_text() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["copy"]  # no temp directory left behind


def test_an_odd_device_count_is_refused_before_tracing_because_iree_cannot_compile_it(tmp_path):
    p = sharktank("export", "--model", "toy-llama-3l", "--pp", "3", "--output-dir", tmp_path / "a", check=False)
    assert p.returncode == 2 and "over 3 devices does not compile with IREE 3.10" in p.stderr, p.stderr
    assert not (tmp_path / "a").exists()
    # The refusal stands for a real failure: the same plan written with --no-compile (its
    # prefill and decode) does not compile (when a newer IREE compiles it, this fails and the
    # refusal can go).
    sharktank("export", "--model", "toy-llama-3l", "--pp", "3", "--max-seq-len", "16", "--functions", "prefill,decode", "--no-compile",
              "--output-dir", tmp_path / "b")
    p = sharktank("compile", tmp_path / "b", check=False)
    assert p.returncode != 0 and "is not compatible with the partition affinity" in p.stderr, p.stderr[-2000:]


def test_no_compile_then_compile_then_run(tmp_path):
    d = tmp_path / "one"
    # prefill and decode: the functions `run` calls.
    sharktank("export", "--model", "toy-llama", "--max-seq-len", "16", "--functions", "prefill,decode", "--no-compile", "--output-dir", d)
    assert not (d / "model.vmfb").exists()
    p = sharktank("run", d, "--tokens", "1,2", check=False)
    assert p.returncode == 2 and "not compiled yet" in p.stderr
    sharktank("compile", d)
    r = json.loads(sharktank("run", d, "--tokens", "1,2,3", "--max-new-tokens", "3", "--compare-eager", "--json").stdout)
    assert r["eager_ids_match"] and r["max_abs_error_vs_eager"] <= 1e-4
    existing = tmp_path / "precious"
    existing.mkdir()
    (existing / "notes.txt").write_text("keep me")
    p = sharktank("export", "--model", "toy-llama", "--no-compile", "--output-dir", existing, check=False)
    assert p.returncode == 2 and (existing / "notes.txt").read_text() == "keep me"
    assert "may replace" in p.stderr and "exporting" not in p.stderr  # refused before the tracing, not after


@pytest.fixture(scope="module")
def dualpipev(tmp_path_factory):
    d = tmp_path_factory.mktemp("art") / "dpv"
    p = sharktank("export", "--recipe", ROOT / "exports" / "toy-llama-dualpipev.toml", "--no-compile", "--output-dir", d, "--json")
    return d, json.loads(p.stdout)


def test_dualpipev_recipe_exports_path_transfers(dualpipev):
    d, summary = dualpipev
    # Batch 2 = one microbatch per V path; each V (0->1->1->0, 2->3->3->2) crosses 2 device
    # boundaries. Inputs arrive on device 0: positions go to 1 (first V); tokens to 2 and
    # positions to 2 and 3 (second V). prefill_row_bs2 (one prompt, run along both Vs: the
    # row is a runtime value) moves the same and the row index from device 0 to 1, 2 and 3;
    # prefill_rows_bs2 moves prefill_bs2's and the padding mask where the positions go (1, 2, 3).
    # Each prefill sends its kept positions to the second V's head on device 2 (1).
    assert summary["transfers"] == {"prefill_bs2": 4 + 1 + 3 + 1, "decode_bs2": 4 + 1 + 3, "prefill_row_bs2": 4 + 1 + 3 + 3 + 1, "prefill_rows_bs2": 4 + 1 + 3 + 3 + 1}
    mlir = (d / "model.mlir").read_text()
    hops = sorted(set(re.findall(r"flow\.tensor\.transfer .* to #hal\.device\.promise<@__device_(\d)>", mlir)))
    assert hops == ["0", "1", "2", "3"]


def test_inspect_png_paints_each_path_of_the_dualpipev_drawing(dualpipev, tmp_path):
    from PIL import Image

    from sharktank.export.manifest import parameter_bytes_per_device, read_any
    from sharktank.parallel.drawing import _COLOURS, scene

    d, _ = dualpipev
    text = sharktank("inspect", d, "--png", tmp_path / "plan.png", "--svg", tmp_path / "plan.svg").stdout
    assert "path B: dev 2 -> dev 3 -> dev 3 -> dev 2" in text
    m = read_any(d)
    sc = scene(m.data["parallel"], parameter_bytes_per_device(m), title="dpv: tp=1 pp=4")
    image = Image.open(tmp_path / "plan.png")
    assert image.format == "PNG" and image.size == (2 * sc.width, 2 * sc.height)
    counts = image.convert("RGB").getcolors(image.width * image.height)
    near = lambda c: sum(n for n, px in counts if all(abs(a - int(c[i : i + 2], 16)) <= 12 for a, i in zip(px, (1, 3, 5))))  # noqa: E731
    assert min(near(c) for c in _COLOURS[:2]) > 4 * 150 and near(_COLOURS[2]) == 0  # paths A and B (4 dots each), nothing green
    assert 'stroke="#d62728"' in (tmp_path / "plan.svg").read_text()  # the SVG draws path B in the PNG's red


def test_inspect_png_without_pillow_is_one_line_and_writes_nothing(dualpipev, tmp_path):
    d, _ = dualpipev
    code = ("import sys; sys.modules['PIL'] = None; from sharktank.cli import main; "  # as if Pillow were not installed
            f"sys.exit(main(['inspect', {str(d)!r}, *sys.argv[1:]]))")
    run = lambda *args: subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, cwd=ROOT)  # noqa: E731
    p = run("--svg", tmp_path / "a.svg", "--png", tmp_path / "a.png")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "sharktank inspect: error: --png: writing a PNG needs Pillow (PIL is missing): pip install 'sharktank[draw]'"], p.stderr
    assert not list(tmp_path.iterdir())  # neither picture: both are drawn before either is written
    assert run("--svg", tmp_path / "a.svg").returncode == 0 and (tmp_path / "a.svg").exists()  # the SVG needs no Pillow


def test_help_texts():
    top = sharktank("--help").stdout
    assert all(f"    {cmd} " in top for cmd in ("export", "compile", "run", "inspect"))
    for cmd in ("export", "compile", "run", "inspect"):
        assert "usage: sharktank " + cmd in sharktank(cmd, "--help").stdout
