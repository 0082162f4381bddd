"""Fixtures for the weights tests: one tiny transformers Llama per session, saved two ways."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

HF_KWARGS = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
)


@pytest.fixture(scope="session")
def hf_model():
    """A random transformers LlamaForCausalLM (transformers is imported here, once)."""
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**HF_KWARGS))


@pytest.fixture(scope="session")
def hf_checkpoint(hf_model, tmp_path_factory) -> Path:
    """``save_pretrained`` output with a single ``model.safetensors``."""
    path = tmp_path_factory.mktemp("hf_single")
    hf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_sharded_checkpoint(hf_model, tmp_path_factory) -> Path:
    """``save_pretrained`` output split over several safetensors files plus an index."""
    path = tmp_path_factory.mktemp("hf_sharded")
    hf_model.save_pretrained(path, max_shard_size="20KB")
    return path

