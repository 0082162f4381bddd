"""llama.cpp side by side: decode and prefill of the same GGUF files, ours (``sharktank export``,
then :class:`~sharktank.runtime.CompiledModel`) against llama.cpp's (llama-cpp-python), in
interleaved rounds in one run.

    python tools/bench_llamacpp.py [--files A.gguf,B.gguf=bfloat16,...] [--quantize f16,q8_0,q4_0,q4_1,q4_k_m]
        [--rounds 3] [--steps 32] [--prompt 128] [--ctx 256] [--batch 8] [--llamacpp DIR] [--work DIR] [--json FILE]

Setup, once and never in CI (about 20 minutes on 2 cores): llama-cpp-python built from source
for this CPU into a directory outside the repo, which only this script's llama.cpp workers put
on their path (at its end, so that the venv's own numpy stays first). Not ``GGML_NATIVE``:
``-march=native`` turns on llama.cpp's AMX matmul, whose first ``ldtilecfg`` faults in this VM
(the CPU lists amx_int8, the VM does not enable the tile state), so the features are named
with AMX off, and each other AVX512/VNNI feature on only where ``/proc/cpuinfo`` lists it: AMD
EPYC Zen 4 machines have AVX512-VNNI but not ``avx_vnni`` (a build with ``GGML_AVX_VNNI`` dies
there of SIGILL, a worker "failed (-4)"), and Zen 3 ones have no AVX512 at all::

    on() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
        -DGGML_BMI2=ON -DGGML_AVX_VNNI=$(on avx_vnni) -DGGML_AVX512=$(on avx512f) \
        -DGGML_AVX512_VBMI=$(on avx512vbmi) -DGGML_AVX512_VNNI=$(on avx512_vnni) \
        -DGGML_AVX512_BF16=$(on avx512_bf16) -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF \
        -DGGML_AMX_BF16=OFF -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
        .venv/bin/pip install llama-cpp-python==0.3.36 --target ~/.cache/sharktank/llamacpp

Files: the real SmolLM2-135M-Instruct file (Q8_0 embedding, Q4_1 elsewhere; ``../shared/models``)
and, with ``--quantize``, files made from it by llama.cpp's own quantizer
(``llama_model_quantize``): an F16 file first (the Q4_1 weights expanded), then each other type
from that F16 (Q4_K_M puts K-quants where rows are whole super-blocks, and llama.cpp's legacy
fallbacks where SmolLM2's 576-wide rows are not). They keep the real file's tokenizer and
metadata: llama.cpp loads no file without a vocabulary, and our ``save_gguf`` writes none.

How it measures. Each (round, file, side) is a worker process of its own, so the two runtimes
never share one (llama.cpp's OpenMP threads spin on after each graph) and each loads its
model afresh; a round runs every file's two sides in turn, so a slow spell of this shared
machine hits both alike. Both sides run 2 threads (llama.cpp ``n_threads=2``,
``n_threads_batch=2``; ours IREE's local-task on this machine's 2 cores), on the same token ids
(seeded, drawn from the file's vocabulary), with a KV cache of ``--ctx`` positions.

- decode ms/token: an 8-token prompt, then ``--steps`` single-token steps (the first one a
  warm-up, not counted); the worker's figure is the median step.
- prefill ms: a ``--prompt``-token prompt from an empty cache, ``--prefill-reps`` times after a
  warm-up; the worker's figure is the median.
- with ``--batch B``: the decode step of B sequences at once (ours: the artifact exported with
  ``--batch-sizes 1,B``, ``decode_bs{B}`` after a prefill of the B rows; llama.cpp: one
  context of B sequences, one ``llama_decode`` of a token per sequence a step, every
  sequence's logits read back), the rows' ids the same tokens rotated; the median step.
- run peak RSS of the worker (model loaded, both phases run).

Printed: per file, each side's median over rounds with its min-max, and ours/theirs as the
median of the per-round ratios (with their min-max). Artifacts and made files go to
``--work`` (default ``~/.cache/sharktank/bench-llamacpp``); our artifacts are exported afresh
on each run unless ``--reuse`` (one from older code would measure that code).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REAL_FILE = HERE.parent.parent / "shared" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
# llama.cpp's file types (llama_ftype), by the names its quantize tool takes.
FTYPES = {"f16": "LLAMA_FTYPE_MOSTLY_F16", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0",
          "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M", "q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M",
          "q3_k_m": "LLAMA_FTYPE_MOSTLY_Q3_K_M", "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K"}
THREADS = 2
DECODE_PROMPT = 8  # tokens before the decode steps: a short context


def cache_root() -> Path:
    """``$SHARKTANK_CACHE``, or ``~/.cache/sharktank`` (as tools/make_checkpoint.py's)."""
    return Path(os.environ.get("SHARKTANK_CACHE") or Path.home() / ".cache" / "sharktank")


# ---- workers (one process each) ----------------------------------------------------------


def _import_llama_cpp(directory: Path):
    if not (directory / "llama_cpp").is_dir():
        raise SystemExit(f"llama-cpp-python expected in {directory} (see this script's docstring for the build), found no llama_cpp package there")
    sys.path.append(str(directory))
    import llama_cpp

    return llama_cpp


def _peak_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def ours_worker(artifact: Path, tokens: list[int], steps: int, prompt: int, reps: int, driver: str | None, batch: int = 0) -> dict:
    """Decode and prefill times of our compiled artifact (see the module docstring) on IREE's
    ``driver`` (None: the artifact's own); with ``batch``, also a decode step of that many rows."""
    import torch

    from sharktank.runtime import CompiledModel

    model = CompiledModel(artifact, driver=driver)
    ids = torch.tensor([tokens], dtype=torch.int64)
    prefill = []
    for r in range(reps + 1):
        t0 = time.perf_counter()
        logits, _ = model.prefill(ids[:, :prompt], logits="last")  # as llama.cpp: the last position's only
        logits[0, -1].argmax().item()  # the result read back, as a caller would
        if r:
            prefill.append(time.perf_counter() - t0)
    _, cache = model.prefill(ids[:, :DECODE_PROMPT], logits="last")
    decode = []
    for i in range(steps):
        pos = DECODE_PROMPT + i
        t0 = time.perf_counter()
        logits, cache = model.decode(ids[:, pos], cache, torch.tensor([pos]))
        logits[0, -1].argmax().item()
        if i:
            decode.append(time.perf_counter() - t0)
    out = {"decode_ms": _median_ms(decode), "prefill_ms": _median_ms(prefill)}
    if batch:
        rows = torch.tensor([_row_tokens(tokens, r) for r in range(batch)], dtype=torch.int64)
        _, cache = model.prefill(rows[:, :DECODE_PROMPT], logits="last")
        steps_b = []
        for i in range(steps):
            pos = DECODE_PROMPT + i
            t0 = time.perf_counter()
            logits, cache = model.decode(rows[:, pos], cache, torch.full((batch,), pos))
            logits[:, -1].argmax(-1).tolist()
            if i:
                steps_b.append(time.perf_counter() - t0)
        out["batch_decode_ms"] = _median_ms(steps_b)
    return {**out, "peak_rss_mib": _peak_rss_mib()}


def _row_tokens(tokens: list[int], row: int) -> list[int]:
    """Batch row ``row``'s token ids: the tokens rotated by ``row`` (different rows, same ids)."""
    return tokens[row:] + tokens[:row]


def theirs_batch_worker(llamacpp: Path, gguf: Path, tokens: list[int], steps: int, batch: int, ctx: int) -> dict:
    """llama.cpp's decode step of ``batch`` sequences at once (its low-level API: one context of
    ``batch`` sequences, ``ctx`` positions each, one ``llama_decode`` of a token per sequence a
    step, every sequence's logits read back), after a ``DECODE_PROMPT``-token prompt per sequence."""
    import numpy as np

    lc = _import_llama_cpp(llamacpp)
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = ctx * batch, 512, 512, batch
    params.n_threads = params.n_threads_batch = THREADS
    context = lc.llama_init_from_model(model, params)
    vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    lots = lc.llama_batch_init(batch * DECODE_PROMPT, 0, 1)
    rows = [_row_tokens(tokens, r) for r in range(batch)]

    def step(at: int, length: int) -> None:  # tokens at..at+length of every row, the last ones' logits
        lots.n_tokens = batch * length
        for r in range(batch):
            for j in range(length):
                i = r * length + j
                lots.token[i], lots.pos[i], lots.n_seq_id[i], lots.seq_id[i][0] = rows[r][at + j], at + j, 1, r
                lots.logits[i] = j == length - 1
        if lc.llama_decode(context, lots) != 0:
            raise RuntimeError("llama_decode failed")
        for r in range(batch):
            np.ctypeslib.as_array(lc.llama_get_logits_ith(context, (r + 1) * length - 1), shape=(vocab,)).argmax()

    try:
        step(0, DECODE_PROMPT)
        times = []
        for i in range(steps):
            t0 = time.perf_counter()
            step(DECODE_PROMPT + i, 1)
            if i:
                times.append(time.perf_counter() - t0)
    finally:
        lc.llama_batch_free(lots)
        lc.llama_free(context)
        lc.llama_model_free(model)
    return {"batch_decode_ms": _median_ms(times)}


def theirs_worker(llamacpp: Path, gguf: Path, tokens: list[int], steps: int, prompt: int, reps: int, ctx: int) -> dict:
    """The same measurements with llama.cpp's ``Llama.eval``, whose last token's logits are read
    (as ours are: argmax)."""
    import numpy as np

    llama_cpp = _import_llama_cpp(llamacpp)
    llm = llama_cpp.Llama(str(gguf), n_threads=THREADS, n_threads_batch=THREADS, n_ctx=ctx, n_batch=max(prompt, 512), verbose=False)

    def read_back() -> None:
        np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),)).argmax()
    prefill = []
    for r in range(reps + 1):
        llm.reset()  # eval then drops the cache from position 0 on
        t0 = time.perf_counter()
        llm.eval(tokens[:prompt])
        read_back()
        if r:
            prefill.append(time.perf_counter() - t0)
    llm.reset()
    llm.eval(tokens[:DECODE_PROMPT])
    decode = []
    for i in range(steps):
        t0 = time.perf_counter()
        llm.eval([tokens[DECODE_PROMPT + i]])
        read_back()
        if i:
            decode.append(time.perf_counter() - t0)
    return {"decode_ms": _median_ms(decode), "prefill_ms": _median_ms(prefill), "peak_rss_mib": _peak_rss_mib(), "system": llama_cpp.llama_print_system_info().decode()}


def quantize_worker(llamacpp: Path, source: Path, out: Path, kind: str) -> dict:
    """``source`` to ``out`` in llama.cpp file type ``kind`` by llama.cpp's own quantizer."""
    import ctypes

    llama_cpp = _import_llama_cpp(llamacpp)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[kind])
    params.nthread = THREADS
    params.allow_requantize = True  # the real file is quantized already (its F16 is made from it)
    tmp = out.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize {source} -> {kind}: expected 0, found {rc}")
    tmp.rename(out)
    return {"path": str(out)}


# ---- the run -----------------------------------------------------------------------------


def _worker(*args: str, env: dict[str, str] | None = None) -> dict:
    """Run this script as a worker (``env``: added to its environment); its last stdout line is
    its JSON result."""
    p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", *args], capture_output=True, text=True,
                       env={**os.environ, **(env or {})})
    if p.returncode != 0:
        hint = " (SIGILL: an instruction this CPU lacks; rebuild llama-cpp-python as this script's docstring says)" if p.returncode == -4 else ""
        raise SystemExit(f"worker {' '.join(args[:2])} failed ({p.returncode}){hint}:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def made_files(source: Path, kinds: list[str], work: Path, llamacpp: Path) -> dict[str, Path]:
    """llama.cpp's quantizations of ``source``, made once into ``work``: F16 from the source,
    the others from that F16."""
    out: dict[str, Path] = {}
    stem = source.name.split(".")[0]

    def name(kind: str) -> Path:  # not the source's name where it has the same type
        return work / f"llamacpp-{stem}.{kind.upper()}.gguf"

    f16 = name("f16")
    for kind in (["f16"] if kinds else []) + [k for k in kinds if k != "f16"]:
        path = name(kind)
        if not path.is_file():
            print(f"  quantizing {kind} with llama.cpp ...", flush=True)
            _worker("quantize", str(llamacpp), str(source if kind == "f16" else f16), str(path), kind)
        if kind in kinds:
            out[path.name] = path
    return out


def export_ours(gguf: Path, artifact: Path, ctx: int, reuse: bool, dtype: str | None, exact_prompts: bool = False, batch: int = 0) -> None:
    if reuse and (artifact / "manifest.json").is_file():
        return
    args = [sys.executable, "-m", "sharktank.cli", "export", "--model", str(gguf), "--max-seq-len", str(ctx), "--output-dir", str(artifact)]
    if batch > 1:
        args += ["--batch-sizes", f"1,{batch}", "--functions", "prefill,decode,prefill_chunk"]  # prefill_chunk_bs1: long prompts in chunks
    if dtype:
        args += ["--dtype", dtype]
    if exact_prompts:
        args.append("--exact-prompts")
    t0 = time.perf_counter()
    p = subprocess.run(args, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"sharktank export {gguf.name} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    print(f"  exported and compiled {gguf.name} in {time.perf_counter() - t0:.0f} s", flush=True)


def vocab_size(gguf: Path) -> int:
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.tokens")
    if field is None:
        raise SystemExit(f"{gguf}: a tokenizer (tokenizer.ggml.tokens) expected, found none: llama.cpp cannot load it")
    return len(field.data)


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})"


def table(results: dict[str, dict[str, list[dict]]], batch: int = 0) -> str:
    """Markdown rows: medians over rounds (min-max) and the median per-round ratio ours/theirs."""
    keys = ["decode_ms", "prefill_ms"] + (["batch_decode_ms"] if batch else [])
    head = "| file | our decode ms/token | llama.cpp decode ms/token | ratio | our prefill ms | llama.cpp prefill ms | ratio "
    if batch:
        head += f"| our decode ms/step, {batch} rows | llama.cpp's | ratio "
    head += "| peak RSS MiB ours / theirs |\n|" + "---|" * (3 * len(keys) + 2)
    lines = [head]
    for name, sides in results.items():
        cells = [name]
        for key in keys:
            ours, theirs = [r[key] for r in sides["ours"]], [r[key] for r in sides["theirs"]]
            ratios = [a / b for a, b in zip(ours, theirs)]
            cells += [_spread(ours), _spread(theirs), _spread(ratios)]
        cells.append(f"{max(r['peak_rss_mib'] for r in sides['ours']):.0f} / {max(r['peak_rss_mib'] for r in sides['theirs']):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", default=str(REAL_FILE), help="comma-separated GGUF files to time (default: the real SmolLM2 file); "
                        "FILE=DTYPE: our export of FILE with --dtype DTYPE (e.g. an F16 file as bfloat16), a row of its own against the same llama.cpp file")
    parser.add_argument("--quantize", default="", help=f"also time llama.cpp's quantizations of the first file, comma-separated: {','.join(FTYPES)}")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per worker, the first not counted (default 32)")
    parser.add_argument("--prompt", type=int, default=128, help="prefill prompt tokens (default 128)")
    parser.add_argument("--prefill-reps", type=int, default=3, help="timed prefills per worker, after one warm-up (default 3)")
    parser.add_argument("--batch", type=int, default=0, help="also time a decode step of this many sequences at once (ours: "
                        "exported with --batch-sizes 1,BATCH; llama.cpp: one context of BATCH sequences); default: off")
    parser.add_argument("--ctx", type=int, default=256, help="KV-cache positions, both sides (default 256)")
    parser.add_argument("--dtype", default=None, help="our export's --dtype (default: as stored)")
    parser.add_argument("--exact-prompts", action="store_true", help="our export's --exact-prompts (prompts of quantized float32 "
                        "models as dense products instead of the bfloat16 prefill dispatches)")
    parser.add_argument("--driver", default=None, choices=("local-task", "local-sync"),
                        help="our runtime driver (default: the artifact's, local-task: 2 worker threads; local-sync runs on one)")
    parser.add_argument("--omp-passive", action="store_true",
                        help="llama.cpp's OpenMP threads sleep instead of spinning (OMP_WAIT_POLICY=PASSIVE): on a machine "
                        "loaded by other work, spinning threads lose their time slices (SmolLM2 Q4_1 decode here under a load of 4-6: "
                        "41 ms/token spinning, 20 ms passive); default: llama.cpp's own setting")
    parser.add_argument("--llamacpp", type=Path, default=cache_root() / "llamacpp", help="where llama-cpp-python is installed (pip --target)")
    parser.add_argument("--work", type=Path, default=cache_root() / "bench-llamacpp", help="made files and our artifacts")
    parser.add_argument("--reuse", action="store_true", help="keep our artifacts from an earlier run")
    parser.add_argument("--json", type=Path, default=None, help="also write every worker's figures here")
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return _run_worker(args.worker)
    if args.prompt + 1 > args.ctx or DECODE_PROMPT + args.steps > args.ctx:
        parser.error(f"--ctx {args.ctx} must hold the prompt ({args.prompt} tokens) and {DECODE_PROMPT} + --steps ({args.steps}) decode positions")
    args.work.mkdir(parents=True, exist_ok=True)
    files, dtypes = {}, {}
    for spec in (f for f in args.files.split(",") if f):
        path, _, dtype = spec.partition("=")
        name = Path(path).name + (f" as {dtype}" if dtype else "")
        files[name], dtypes[name] = Path(path), dtype or args.dtype
    kinds = [k for k in args.quantize.split(",") if k]
    unknown = [k for k in kinds if k not in FTYPES]
    if unknown:
        parser.error(f"--quantize: expected some of {', '.join(FTYPES)}, found {', '.join(unknown)}")
    if kinds:
        files.update(made_files(next(iter(files.values())), kinds, args.work, args.llamacpp))
    load = os.getloadavg()
    print(f"== llama.cpp side by side: {len(files)} files, {args.rounds} rounds; load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}", flush=True)
    variant = ("-exact" if args.exact_prompts else "") + (f"-b{args.batch}" if args.batch else "")
    artifacts = {name: args.work / f"ours-{path.stem}{'-' + dtypes[name] if dtypes.get(name) else ''}{variant}" for name, path in files.items()}
    for name, path in files.items():
        export_ours(path, artifacts[name], args.ctx, args.reuse, dtypes.get(name), args.exact_prompts, args.batch)
    tokens = {}
    for name, path in files.items():
        g, vocab = random.Random(0), vocab_size(path)
        tokens[name] = json.dumps([g.randrange(vocab) for _ in range(max(args.prompt, DECODE_PROMPT + args.steps))])
    common = (str(args.steps), str(args.prompt), str(args.prefill_reps))
    results: dict[str, dict[str, list[dict]]] = {name: {"ours": [], "theirs": []} for name in files}
    omp = {"OMP_WAIT_POLICY": "PASSIVE"} if args.omp_passive else None
    system = None
    for r in range(args.rounds):
        for name, path in files.items():
            ours = _worker("ours", str(artifacts[name]), tokens[name], *common, args.driver or "", str(args.batch))
            theirs = _worker("theirs", str(args.llamacpp), str(path), tokens[name], *common, str(args.ctx), env=omp)
            system = theirs.pop("system")
            if args.batch:
                theirs.update(_worker("theirs-batch", str(args.llamacpp), str(path), tokens[name], str(args.steps), str(args.batch), str(args.ctx), env=omp))
            results[name]["ours"].append(ours)
            results[name]["theirs"].append(theirs)
            print(f"  round {r + 1}/{args.rounds} {name}: decode {ours['decode_ms']:.2f} / {theirs['decode_ms']:.2f} ms, "
                  f"prefill {ours['prefill_ms']:.1f} / {theirs['prefill_ms']:.1f} ms"
                  + (f", decode of {args.batch} rows {ours['batch_decode_ms']:.1f} / {theirs['batch_decode_ms']:.1f} ms" if args.batch else "")
                  + " (ours / llama.cpp)", flush=True)
    load = os.getloadavg()
    print(f"\nllama.cpp: {system}{' (OMP_WAIT_POLICY=PASSIVE)' if omp else ''}\nload average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          f"decode at a context of {DECODE_PROMPT}-{DECODE_PROMPT + args.steps} tokens, prefill of {args.prompt} tokens; "
          f"medians over {args.rounds} rounds (min-max); ratio = ours / llama.cpp per round\n")
    print(table(results, args.batch))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results}, indent=1))
    return 0


def _run_worker(argv: list[str]) -> int:
    kind, rest = argv[0], argv[1:]
    if kind == "ours":
        artifact, tokens, steps, prompt, reps, driver, batch = rest
        result = ours_worker(Path(artifact), json.loads(tokens), int(steps), int(prompt), int(reps), driver or None, int(batch))
    elif kind == "theirs-batch":
        llamacpp, gguf, tokens, steps, batch, ctx = rest
        result = theirs_batch_worker(Path(llamacpp), Path(gguf), json.loads(tokens), int(steps), int(batch), int(ctx))
    elif kind == "theirs":
        llamacpp, gguf, tokens, steps, prompt, reps, ctx = rest
        result = theirs_worker(Path(llamacpp), Path(gguf), json.loads(tokens), int(steps), int(prompt), int(reps), int(ctx))
    elif kind == "quantize":
        llamacpp, source, out, ftype = rest
        result = quantize_worker(Path(llamacpp), Path(source), Path(out), ftype)
    else:
        raise SystemExit(f"worker: expected ours, theirs or quantize, found {kind!r}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
