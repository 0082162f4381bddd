"""The weights package's public surface and import cost."""

from __future__ import annotations

import subprocess
import sys

import sharktank.weights as weights


def test_public_api():
    assert issubclass(weights.WeightsError, ValueError)
    for name in weights.__all__:
        assert getattr(weights, name) is not None, name
    formats = {"load_hf_checkpoint", "load_gguf", "save_gguf", "load_irpa", "save_irpa", "load_theta", "save_theta"}
    assert formats <= set(weights.__all__)


def test_import_pulls_in_no_iree_gguf_or_safetensors():
    code = (
        "import sys, sharktank.weights; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('iree', 'gguf', 'safetensors', 'transformers')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_error_message_names_file_and_tensor():
    err = weights.WeightsError("shape [2] disagrees", path="/x/model.safetensors", tensor="model.norm.weight")
    assert str(err) == "/x/model.safetensors: tensor 'model.norm.weight': shape [2] disagrees"
    assert (err.path, err.tensor) == ("/x/model.safetensors", "model.norm.weight")
