"""Chunked prefill and prefix reuse on a compiled artifact (not a test; numbers for issue 30).

    sharktank export --model ../shared/models/SmolLM2-135M-Instruct.Q4_1.gguf --batch-sizes 1,4 --max-seq-len 1024 --output-dir /tmp/rm/art
    python tools/bench_chunked.py /tmp/rm/art

Prints (1) a 300-token prompt prefilled in chunks 128+1+171 against the whole prefill (max logit
difference, greedy equality); (2) time to first token of requests sharing a 400-token system
prompt with prefix reuse off and on, 3 interleaved rounds (median, range); (3) the longest
inter-token gap of a running stream while a 900-token prompt is admitted, whole prompts against
64-token chunks. About 2 minutes here.
"""
import statistics, sys, threading, time
import torch
from sharktank.runtime import CompiledModel
from sharktank.serving.engine import Engine
from sharktank.text.sampling import SamplingParams

if len(sys.argv) != 2 or sys.argv[1] in ('-h', '--help'):
    print(__doc__)
    raise SystemExit(0 if sys.argv[1:] in (['-h'], ['--help']) else 2)
art = sys.argv[1]
m = CompiledModel(art)
torch.manual_seed(0)
V = m.vocab_size
prompt = torch.randint(0, V, (300,)).tolist()
whole, _ = m.prefill(torch.tensor([prompt]))
cache = m.new_cache(1)
parts = []
for a, b in ((0, 128), (128, 129), (129, 300)):
    out, cache = m.prefill_chunk(prompt, a, b, 0, cache)
    parts.append(out)
err = float((torch.cat(parts).float() - whole[0].float()).abs().max())
print(f"chunked vs whole prefill, 300 tokens in 128+1+171: max |diff| {err:.3g} (max |logit| {float(whole.abs().max()):.3g}); greedy last equal: {int(torch.cat(parts)[-1].argmax()) == int(whole[0, -1].argmax())}")

system = torch.randint(0, V, (400,)).tolist()
questions = [torch.randint(0, V, (12,)).tolist() for _ in range(6)]

def ttfts(engine):
    out = []
    for q in questions:
        t0 = time.perf_counter(); got = threading.Event(); first = []
        def on(e, t0=t0):
            if not first: first.append(time.perf_counter() - t0)
            if e.finish_reason is not None: got.set()
        engine.submit(system + q, SamplingParams(max_tokens=2), on); got.wait(120)
        out.append(first[0])
    return out[1:]  # the first request fills the row

res = {"off": [], "on": []}
answers = {}
for rnd in range(3):
    for mode, chunk in (("off", None), ("on", 256)):
        e = Engine(m, batch_size=1, chunk_tokens=chunk); e.start()
        try:
            res[mode].append(statistics.median(ttfts(e)))
        finally:
            e.stop()
for mode, v in res.items():
    print(f"TTFT, 400-token shared system prompt + 12-token question, prefix reuse {mode}: median {statistics.median(v)*1e3:.0f} ms (rounds {', '.join(f'{x*1e3:.0f}' for x in v)})")
print(f"ratio off/on: {statistics.median(res['off'])/statistics.median(res['on']):.1f}x")

# gaps of one stream while a 900-token prompt is admitted
long = torch.randint(0, V, (900,)).tolist()
for chunk in (None, 64):
    e = Engine(m, batch_size=4 if m.find('decode', 4) else 1, chunk_tokens=chunk); e.start()
    stamps, done = [], threading.Event()
    def on(ev):
        stamps.append(time.perf_counter())
        if ev.finish_reason is not None: done.set()
    e.submit(prompt[:20], SamplingParams(max_tokens=60), on)
    while len(stamps) < 10: time.sleep(0.01)
    d2 = threading.Event()
    e.submit(long, SamplingParams(max_tokens=1), lambda ev: d2.set() if ev.finish_reason else None)
    done.wait(300); d2.wait(300); e.stop()
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    print(f"stream gaps while a 900-token prompt is admitted, chunk {chunk}: median {statistics.median(gaps)*1e3:.1f} ms, longest {max(gaps)*1e3:.0f} ms ({max(gaps)/statistics.median(gaps):.1f}x)")
