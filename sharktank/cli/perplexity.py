"""`sharktank perplexity`: a text file's perplexity under a compiled artifact or a model source."""

from __future__ import annotations

import json
from pathlib import Path

from .common import CliError, say

__all__ = ["add_parser", "cmd_perplexity"]

NAME = "perplexity"
HELP = "perplexity of a text file, as llama.cpp's llama-perplexity computes it"  # the line in `sharktank --help`


def cmd_perplexity(args) -> int:
    from ..evaluate import PerplexityError, bos_to_add, check_window, open_target, perplexity

    text_path = Path(args.text)
    if not text_path.is_file():
        raise CliError(f"--text {text_path}: no such file")
    try:
        text = text_path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise CliError(f"--text {text_path}: not UTF-8 text ({e})") from None
    target = open_target(args.target)
    try:
        ids = target.tokenizer.encode(text, add_special_tokens=True)
        bos = bos_to_add(target.tokenizer)
        check_window(args.window, len(ids), target.max_seq_len)  # before the weights load
        say(args, f"{len(ids)} tokens; loading {args.target} ({target.kind})")
        logits_of = target.load()

        def progress(done: int, total: int, ppl: float, tok_s: float) -> None:
            say(args, f"[{done}/{total}] perplexity {ppl:.4f} ({tok_s:.0f} tok/s)")

        result = perplexity(logits_of, ids, args.window, bos_id=bos, max_seq_len=target.max_seq_len, on_chunk=progress)
    except PerplexityError as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps({**result.to_dict(), "tokens": len(ids), "bos_id": bos, "model": str(args.target), "kind": target.kind}))
    else:
        print(f"perplexity: {result.ppl:.4f} ({result.tokens_scored} tokens scored in {result.chunks} chunks of {result.window}, {result.tokens_per_s:.0f} tok/s)")
    return 0


def add_parser(sub) -> None:
    """Declare `sharktank perplexity` on the subcommand set ``sub``."""
    from ..evaluate import METHOD
    from ..models import SOURCES_HELP

    pp = sub.add_parser(
        NAME, help=HELP,
        description=f"Perplexity of the text in FILE under the model DIR|MODEL. {METHOD} A compiled artifact runs each chunk as one "
        "prefill (logits of every position); a model source runs eagerly in torch.",
    )
    pp.add_argument("target", metavar="DIR|MODEL", help=f"a compiled export directory with a tokenizer, or a model: {SOURCES_HELP}")
    pp.add_argument("--text", required=True, metavar="FILE", help="the UTF-8 text to score (at least one window of tokens)")
    pp.add_argument("--window", type=int, default=512, help="tokens per chunk (llama.cpp's -c): even, at most the model's or artifact's "
        "max_seq_len (default 512)")
    pp.add_argument("--json", action="store_true", help="print one JSON object (ppl, nll, tokens scored, chunks, window, tokens/s, running ppl per chunk)")
    pp.set_defaults(func=cmd_perplexity)
