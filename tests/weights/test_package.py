"""The weights package's public surface and import cost."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sharktank.weights as weights


def test_public_api():
    assert issubclass(weights.WeightsError, ValueError)
    for name in weights.__all__:
        assert getattr(weights, name) is not None, name
    formats = {"read_gguf", "write_gguf", "scan_checkpoint", "load_irpa", "save_irpa", "load_sharded", "save_sharded"}
    assert formats <= set(weights.__all__)
    # The Llama loaders and savers live with the model (issue 14), beside load_model.
    import sharktank.models as models

    llama_formats = {"load_hf_checkpoint", "load_gguf", "save_gguf", "load_theta", "save_theta", "quantize_gguf"}
    assert llama_formats <= set(models.__all__)
    for name in models.__all__:
        assert getattr(models, name) is not None, name


def test_formats_import_no_model():
    # The layering is one-way: models import weights, weights never imports models.
    root = Path(weights.__file__).parent
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = "." * node.level + (node.module or "")
                names = [module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for module in names:
                assert "models" not in module.split("."), f"{path.name} imports {module}"


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
