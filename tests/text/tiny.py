"""A tiny byte-level BPE tokenizer trained here (nothing downloaded), and the files a
checkpoint or a GGUF would carry for it."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Sharding splits the weights of a model across devices.",
    "Café, naïve, façade: déjà vu in the résumé.",
    "日本語のテキストも少し。東京と京都。",
    "Emoji too: 🦊🐶 and ✨ sparkles ✨!",
    "Numbers 12345 and 2024-06-01, tabs\tand\nnew lines.\n",
    "the the the model model devices devices weights",
]
SPECIAL = ["<s>", "</s>", "<|end|>"]
# A chat template in the style checkpoints ship (bos_token, messages, add_generation_prompt).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>\n{{ m['content'] | trim }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@lru_cache(maxsize=1)
def _trained_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(SENTENCES * 3, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok.to_str()


def tiny_bpe():
    """A fresh copy of the trained tokenizer (tokenizers.Tokenizer)."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_json())


def reference(tok=None):
    """transformers' fast tokenizer over the same tokenizer: the reference encode/decode/chat."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=tok or tiny_bpe(), bos_token="<s>", eos_token="</s>", chat_template=CHAT_TEMPLATE)


def write_checkpoint_tokenizer(directory: Path) -> None:
    """tokenizer.json and tokenizer_config.json as a Hugging Face checkpoint has them."""
    directory.mkdir(parents=True, exist_ok=True)
    tiny_bpe().save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def write_tiny_checkpoint(directory: Path, *, layers: int, heads: int, kv_heads: int) -> Path:
    """A random-weight transformers Llama (vocab 400, hidden 32, seeded) saved in ``directory``
    with the tiny tokenizer, as a Hugging Face checkpoint is laid out."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=400, hidden_size=32, intermediate_size=48, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    LlamaForCausalLM(config).save_pretrained(directory)
    write_checkpoint_tokenizer(directory)
    return directory


def write_gguf_tokenizer(path: Path, *, add_bos: bool = True) -> None:
    """A GGUF holding only the tiny tokenizer's metadata, as llama.cpp's converter writes it."""
    from gguf import GGUFWriter

    tok = tiny_bpe()
    spec = json.loads(tok.to_str())
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    w = GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIAL else 1 for t in tokens])
    w.add_bos_token_id(vocab["<s>"])
    w.add_eos_token_id(vocab["</s>"])
    w.add_add_bos_token(add_bos)
    w.add_chat_template(CHAT_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_gguf_stub(path: Path, model: str | None) -> None:
    """A GGUF whose tokenizer metadata is only a model kind and two tokens (or nothing)."""
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), "llama")
    if model:
        w.add_tokenizer_model(model)
        w.add_token_list(["a", "b"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
