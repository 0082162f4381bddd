"""`sharktank run`: generate with a compiled artifact, from token ids (greedy) or text."""

from __future__ import annotations

import json
import statistics
import time

from .common import CliError, add_runtime_options, follow_rank0, ints, multi_host, open_model, say, text_dir

__all__ = ["add_parser", "cmd_run"]

NAME = "run"
HELP = "generate with a compiled directory: token ids (greedy) or text"  # the line in `sharktank --help`


def _timings(model, t0: float, loaded: float) -> dict:
    from ..runtime.process import seconds_since_process_start

    decode = [t * 1e3 for t in model.timings["decode"]]
    started = seconds_since_process_start(loaded)
    return {
        "prefill_ms": round(model.timings["prefill"][0] * 1e3, 3),
        "decode_ms_per_token": {
            "median": round(statistics.median(decode), 3) if decode else None,
            "min": round(min(decode), 3) if decode else None,
            "max": round(max(decode), 3) if decode else None,
        },
        "load_s": round(loaded - t0, 3),
        # From the process's start (interpreter and imports included) to the first token's logits.
        "first_token_s": round(started + model.timings["prefill"][0], 3) if started is not None else None,
        "device_count": model.device_count,
        "dtype": model.manifest.dtype,
        "driver": model.driver,
    }


def _run_prompt(args, distributed: bool) -> int:
    from ..text import SamplingParams, load_tokenizer
    from ..text.generate import generate_text

    if distributed and follow_rank0(args):  # rank 0 owns the text: the others open no tokenizer
        return 0
    tokenizer = load_tokenizer(text_dir(args.dir, distributed))
    if tokenizer is None:
        raise CliError(f"{args.dir}: the artifact has no tokenizer (its export source carried none); give token ids with --tokens")
    try:
        params = SamplingParams(
            max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, stop_token_ids=tokenizer.eos_token_ids,
        )
        text = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    except ValueError as e:
        raise CliError(str(e)) from None
    # A chat template writes the BOS token itself.
    prompt_ids = tokenizer.encode(text, add_special_tokens=not args.chat)
    if not prompt_ids:
        raise CliError("--prompt encodes to no tokens")
    t0 = time.perf_counter()
    model, _ = open_model(args, distributed)
    loaded = time.perf_counter()
    try:
        limit = min(f.max_seq_len for f in model.functions.values())
        if len(prompt_ids) + params.max_tokens > limit:
            raise CliError(f"the prompt's {len(prompt_ids)} tokens + --max-new-tokens {params.max_tokens} exceed the exported cache length {limit}")
        show = (lambda piece: None) if args.json else (lambda piece: print(piece, end="", flush=True))
        gen = generate_text(model, tokenizer, prompt_ids, params, stop=args.stop, on_text=show)
    finally:
        if distributed:
            model.close()  # stops the other ranks (also after an error here)
    result = {"text": gen.text, "ids": gen.ids, "prompt_ids": prompt_ids, "finish_reason": gen.finish_reason, **_timings(model, t0, loaded)}
    if distributed:
        result["hosts"] = model.world_size
    if args.json:
        print(json.dumps(result))
    else:
        print()
        d = result["decode_ms_per_token"]
        say(args, f"{len(gen.ids)} tokens ({gen.finish_reason}); prefill {result['prefill_ms']:.2f} ms; decode {d['median']} ms/token")
    return 0


def cmd_run(args) -> int:
    import numpy as np
    import torch

    distributed = args.distributed or multi_host(args.dir)
    if args.prompt is not None:
        return _run_prompt(args, distributed)
    rows = [ints(r, "--tokens") for r in args.tokens.split(";")]
    if len({len(r) for r in rows}) != 1:
        raise CliError(f"--tokens: every sequence must have the same length, found {[len(r) for r in rows]}")
    tokens = torch.tensor(rows, dtype=torch.int64)
    t0 = time.perf_counter()
    model, rank = open_model(args, distributed)
    if rank != 0:
        model.serve()  # rank 0 owns the prompt and the output
        return 0
    loaded = time.perf_counter()
    ids, logits = model.generate(tokens, args.max_new_tokens)
    result = {"ids": ids.tolist() if len(rows) > 1 else ids[0].tolist(), **_timings(model, t0, loaded)}
    if distributed:
        model.close()
        # Bytes each rank sent, per decode step: what crossed hosts for one token.
        steps = max(model.traffic[0]["steps"]["decode"], 1)
        result["hosts"] = model.world_size
        result["bytes_per_decode_token"] = {r: t["decode"] // steps for r, t in model.traffic.items()}
    if args.compare_eager:
        from ..models.loading import model_from_manifest

        eager = model_from_manifest(model.manifest)
        eager_ids = eager.generate(tokens, args.max_new_tokens)
        # Compare step logits on the compiled module's own token path.
        full = torch.cat([tokens, ids[:, :-1]], dim=1) if args.max_new_tokens > 1 else tokens
        want = eager.prefill(full)[:, tokens.shape[1] - 1 :]
        result["max_abs_error_vs_eager"] = float((logits.float() - want.float()).abs().max())
        result["eager_ids_match"] = bool(torch.equal(eager_ids, ids))
    if args.save_logits:
        from ..weights._files import atomic_file

        with atomic_file(args.save_logits) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, logits.float().numpy())
    if args.json:
        print(json.dumps(result))
    else:
        for row in ids.tolist():
            print("generated ids:", " ".join(map(str, row)))
        d = result["decode_ms_per_token"]
        print(f"prefill {result['prefill_ms']:.2f} ms; decode {d['median']} ms/token (min {d['min']}, max {d['max']})")
        if result["first_token_s"] is not None:
            print(f"loaded in {result['load_s']:.2f} s; first token {result['first_token_s']:.2f} s after the process started")
        if args.compare_eager:
            print(f"max abs error vs eager torch: {result['max_abs_error_vs_eager']:.3g}; same ids as eager: {result['eager_ids_match']}")
    return 0


def add_parser(sub) -> None:
    """Declare `sharktank run` on the subcommand set ``sub``."""
    r = sub.add_parser(
        NAME, help=HELP,
        description="Prefill the prompt, then decode on the compiled module: --tokens takes ids and decodes greedily; "
        "--prompt takes text (encoded with the tokenizer the export copied), samples as --temperature/--top-k/--top-p/--seed say, "
        "stops at the tokenizer's EOS ids or a --stop string and prints the text.",
    )
    r.add_argument("dir", help="a compiled export directory (from `sharktank export`)")
    what = r.add_mutually_exclusive_group(required=True)
    what.add_argument("--tokens", help="prompt token ids, comma-separated; several sequences of one length separated by ';' (the batch must be an exported batch size)")
    what.add_argument("--prompt", help="prompt text (batch 1; needs an artifact with a tokenizer); prints the generated text")
    r.add_argument("--max-new-tokens", type=int, default=8, help="tokens to generate (default 8)")
    r.add_argument("--temperature", type=float, default=0.0, help="--prompt: sampling temperature (default 0: greedy)")
    r.add_argument("--top-k", dest="top_k", type=int, default=0, help="--prompt: sample among the k most likely tokens (default 0: all)")
    r.add_argument("--top-p", dest="top_p", type=float, default=1.0, help="--prompt: sample among the most likely tokens of this total probability (default 1)")
    r.add_argument("--seed", type=int, help="--prompt: sampling seed (default: random)")
    r.add_argument("--stop", action="append", default=[], help="--prompt: stop before this text (repeatable)")
    r.add_argument("--chat", action="store_true", help="--prompt: wrap the prompt as a user message in the tokenizer's chat template")
    r.add_argument("--compare-eager", action="store_true", help="also run eager torch and print the max logit error")
    add_runtime_options(r, serving=False)
    r.add_argument("--save-logits", help="write the logits of every step to this .npy file")
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.set_defaults(func=cmd_run)
