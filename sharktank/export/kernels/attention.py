"""Attention of one query per sequence (a decode step) over a KV cache, as one hand-written CPU
dispatch: what export takes for the static-query-length form of
:func:`sharktank.ops.scaled_dot_product_attention` on the ``cpu`` target.

The torch form (``ops.attention_as_matmuls``) became 6-8 dispatches per layer in IREE 3.10,
reading the whole cache every step whatever the position: a score reduction (at ~1.7 GB/s),
a softmax, a packed float32 copy of V and a product; 9 % of a 1B Q4_K-mix decode step at
tp1 with a 512-entry cache. This dispatch has one workgroup per sequence and KV head. It
walks the cache in chunks of :data:`CHUNK` entries and skips a chunk whose mask is all
false (for a causal mask, every chunk past the position), so a step reads the entries it
attends to, as stored (bfloat16, float16 or float32). Per chunk, for each of the KV head's
``g`` query heads: the 16 scores (``scale * q . k``, float32; for a head dim that is a
multiple of 16, each product folded to 16 lanes and the 16 folds summed lane-wise in four
rounds of shuffles, :func:`_push`, rather than 16 horizontal reductions), their maximum, the running
maximum's correction of the sums so far (``exp(old - new)``, one per chunk), the 16 weights
``exp(score - max)`` (0 where the mask is false), and the weighted values added into a
float32 accumulator of ``head_dim`` lanes (a masked entry's values taken as 0: what a masked
entry holds never reaches the result, not even a NaN). The result is the accumulator over the weights'
sum: a softmax computed online, equal to the torch form up to float32 rounding. While it
reads a chunk it prefetches the next chunk's rows (:func:`_chunk`): a cache larger than the
CPU's caches is read from memory at a chunk's distance ahead, which no hardware prefetcher
does for pages that lie anywhere.

The paged variant (:func:`paged_module_asm`, what export takes for
:func:`sharktank.ops.paged_attention`) walks the same chunks with the same body over pools of
pages (``[P, N, KVH, E]``, P dynamic) instead of a cache: entry ``t`` of a sequence is read at
slot ``t % N`` of page ``pages[seq, t // N]``, the table read once per page a live chunk
touches, so a decode step reads the live entries in place where the torch form gathers all
of each row's pages first. Only where a key or value row is read differs (:data:`Rows`).

The paged prefill variant (:func:`paged_prefill_module_asm`, what export takes for a prompt
chunk's :func:`sharktank.ops.paged_attention`) runs the same walk for each token of the chunk
as a query row of its own, over its sequence's pages and its own row of the (causal) mask:
``kvh * GROUPS`` workgroups, each a KV head and every :data:`GROUPS`-th row. The rows, the
table's width (a prompt's pages) and the pool are dynamic, so the table comes transposed and
the mask flat (only a leading dim of the frame is dynamic), and a row's entries need not fill
its last chunk (those past them are never live). A row reads its sequence's live entries once more per token, which the CPU's caches
serve (a chunk's rows read the same pages); the torch form it replaces gathered every page of
the table and computed the masked products over all of them (SmolLM2's attention shape, 30
layers, a float32 pool: 16 tokens at position 1856 in 35 ms against 413 ms, 256 tokens at
1600 in 356 ms against 6.2 s).
"""

from __future__ import annotations

import struct
from typing import Callable

from .frame import Operand, executable
from .mlir import Emitter, Value, lanes_of, vector

__all__ = ["CHUNK", "GROUPS", "function_name", "module_asm", "paged_function_name", "paged_module_asm", "paged_prefill_function_name", "paged_prefill_module_asm"]

CHUNK = 16  # cache entries per step of the walk (the mask of one chunk: one 16-byte load)
_FLOATS = ("f32", "bf16", "f16")


def _bits(scale: float) -> str:
    """The float32 bits of ``scale`` in hex: its part of the name."""
    return struct.pack(">f", scale).hex().upper()


def function_name(b: int, h: int, t: int, kvh: int, e: int, q_elem: str, kv_elem: str, scale: float) -> str:
    return f"sharktank_decode_attention_{b}x{h}x{t}x{kvh}x{e}_{q_elem}_{kv_elem}_s{_bits(scale)}"


def _load_row(em: Emitter, mem: Value, indices: list[Value], e: int, elem: str) -> Value:
    """``e`` values at ``indices`` of ``mem`` as float32."""
    got = em.load(mem, indices, vector(e, elem), "kv")
    return got if elem == "f32" else em.cast("arith.extf", got, vector(e, "f32"), "kv")


Rows = Callable[[Value, Value, Value], list[list[Value]]]
"""``rows(chunk, seq, head)``: the indices into K and V of the row of each of the :data:`CHUNK`
entries from ``chunk`` on, for sequence ``seq`` and KV head ``head`` (emitted in the chunk's
branch: only an active chunk computes them)."""


_LINE_BYTES = 64  # a cache line: one prefetch each
_BYTES = {"f32": 4, "bf16": 2, "f16": 2}


def _prefetch_row(em: Emitter, mem: Value, row: list[Value], e: int, kv_elem: str) -> None:
    """A prefetch of each cache line of the ``e`` values at ``row`` (its last index: 0) of ``mem``."""
    for lane in range(0, e, _LINE_BYTES // _BYTES[kv_elem]):
        em.prefetch(mem, row[:-1] + [em.const(lane)])


_LANES = 16  # float32 lanes of the products a score is folded to (one AVX-512 register)
assert _LANES == CHUNK, "_push pairs one chunk's 16 folded products into one vector of 16 scores"


def _fold(em: Emitter, q: Value, key: Value) -> Value:
    """``q * key`` (vector<e x f32>, e a multiple of 16) folded to 16 lanes: lane i holds the
    sum of the products at i, i + 16, ... (a multiply, then a fused multiply-add per part)."""
    e = lanes_of(q.type)
    parts = [(em.slice(q, o, _LANES, "qp"), em.slice(key, o, _LANES, "kp")) for o in range(0, e, _LANES)]
    acc = em.binary("arith.mulf", *parts[0], "p")
    for qp, kp in parts[1:]:
        acc = em.fma(qp, kp, acc, "p")
    return acc


def _pair(em: Emitter, a: Value, b: Value, width: int) -> Value:
    """One round of :func:`_push`'s pairing: ``a`` and ``b`` hold ``16 / (2 * width)`` rows of
    ``2 * width`` partial sums each; the result, a's rows then b's, ``width`` each (the first
    and the second ``width`` of each row's partial sums added)."""
    low = [r * 2 * width + i for r in range(CHUNK // (2 * width)) for i in range(width)]
    lo = low + [CHUNK + x for x in low]
    hi = [x + width for x in lo]
    return em.binary("arith.addf", em.shuffle(a, b, lo, "tl"), em.shuffle(a, b, hi, "th"), "ts")


def _push(em: Emitter, stack: list[tuple[Value, int]], row: Value) -> None:
    """Adds the next of 16 vector<16xf32> ``row`` to ``stack``, a binary counter of pairings:
    two entries of one round pair up as soon as both exist (so at most five stay live), and
    after the 16th the one entry left is the rows' lane sums in order (lane i: the sum of
    row i's lanes)."""
    stack.append((row, 0))
    while len(stack) > 1 and stack[-1][1] == stack[-2][1]:
        (b, level), (a, _) = stack.pop(), stack.pop()
        stack.append((_pair(em, a, b, CHUNK // 2 >> level), level + 1))


def _chunk(em: Emitter, k: Value, v: Value, rows: list[list[Value]], ahead: list[list[Value]], queries: list[Value], state: list[Value], live: Value, e: int,
           kv_elem: str) -> list[Value]:
    """An active chunk, its entries' rows of ``k`` and ``v`` at ``rows``: from the running
    maxima, sums and accumulators ``state`` (g of each) to the next ones. The rows ``ahead``
    (the next chunk's) are prefetched along the way, one row of K before each row of K is
    read and one of V before each of V, so that the next chunk's reads find them in cache
    (the chunks of a paged cache lie anywhere in memory: no hardware prefetcher guesses them)."""
    g = len(queries)
    ve, v16 = vector(e, "f32"), vector(CHUNK, "f32")
    m, l, a = state[:g], state[g : 2 * g], state[2 * g :]
    scores = [[None] * CHUNK for _ in range(g)]  # the scalar scores (e not a multiple of 16)
    stacks = [[] for _ in range(g)]  # the pairings of _push (e a multiple of 16)
    tree = e % _LANES == 0
    for tt in range(CHUNK):
        _prefetch_row(em, k, ahead[tt], e, kv_elem)
        key = _load_row(em, k, rows[tt], e, kv_elem)
        for j in range(g):
            if tree:
                _push(em, stacks[j], _fold(em, queries[j], key))
            else:
                scores[j][tt] = em.reduction("add", em.binary("arith.mulf", queries[j], key, "p"), "s")
    ninf16, zero_e = em.const(float("-inf"), v16), em.const(0.0, ve)
    new_m, new_l, weights, acc = [], [], [], []
    for j in range(g):
        row = stacks[j][0][0] if tree else em.from_elements(scores[j], "sv")
        masked = em.select(live, row, ninf16, "sm")
        top = em.binary("arith.maximumf", m[j], em.reduction("maximumf", masked, "mc"), "mn")
        correction = em.unary("math.exp", em.binary("arith.subf", m[j], top, "dm"), "cr")  # 0 while the running maximum is -inf
        w = em.unary("math.exp", em.binary("arith.subf", masked, em.broadcast(top, v16), "ds"), "w")  # 0 where masked
        total = em.binary("arith.addf", em.binary("arith.mulf", l[j], correction, "lc"), em.reduction("add", w, "ws"), "ln")
        new_m.append(top)
        new_l.append(total)
        weights.append(w)
        acc.append(em.binary("arith.mulf", a[j], em.broadcast(correction, ve), "ac"))
    for tt in range(CHUNK):
        _prefetch_row(em, v, ahead[tt], e, kv_elem)
        value = _load_row(em, v, rows[tt], e, kv_elem)
        # A masked entry's values count 0 whatever they are (0 * NaN would be NaN).
        value = em.select(em.extract(live, tt, "lv"), value, zero_e, "vz")
        for j in range(g):
            weight = em.broadcast(em.extract(weights[j], tt, "w"), ve, "wb")
            acc[j] = em.fma(weight, value, acc[j], "a")
    return new_m + new_l + acc


Live = Callable[[Value], Value]
"""``live(chunk)``: the vector<16xi1> of which of the :data:`CHUNK` entries from ``chunk`` on
the row attends."""


def _mask_row(em: Emitter, mask: Value, row: Value) -> Live:
    """A row of an int8 ``mask`` [rows, t] (t a multiple of :data:`CHUNK`): not 0 = attended."""
    zero = em.const(0, vector(CHUNK, "i8"))
    return lambda chunk: em.cmp("arith.cmpi", "ne", em.load(mask, [row, chunk], vector(CHUNK, "i8"), "mk"), zero, "live")


def _walk(em: Emitter, row: Value, seq: Value, head: Value, q: Value, k: Value, v: Value, live_of: Live, out: Value, *, h: int, kvh: int, t: int | Value,
          e: int, q_elem: str, kv_elem: str, scale: float, rows: Rows) -> None:
    """The body every dispatch shares: for query row ``row`` (of ``q`` and ``out``) of
    sequence ``seq`` and KV head ``head``, its ``g`` query heads' online softmax over ``t``
    entries (a static multiple of :data:`CHUNK`, or a value: a multiple of it that covers
    them, the entries past them never live) chunk by chunk, a chunk none of whose entries
    ``live_of`` says are live skipped, K and V rows where ``rows`` says, the result stored."""
    g = h // kvh
    c, ve = em.const, vector(e, "f32")
    t = c(t) if isinstance(t, int) else t
    last_chunk = em.binary("arith.subi", t, c(CHUNK), "lastc")
    h0 = em.binary("arith.muli", head, c(g), "h0")
    scale_v = em.broadcast(c(scale, "f32"), ve, "scale")
    heads = [em.binary("arith.addi", h0, c(j), "hq") for j in range(g)]
    queries = [em.binary("arith.mulf", _load_row(em, q, [row, hq, c(0)], e, q_elem), scale_v, "q") for hq in heads]
    fz, ninf, zero_e = c(0.0, "f32"), c(float("-inf"), "f32"), c(0.0, ve)

    def step(chunk: Value, state: list[Value]) -> list[Value]:
        live = live_of(chunk)
        any_live = em.reduction("or", live, "any")

        def active() -> list[Value]:
            # The next chunk's rows (the last chunk's own at the end), for the prefetches.
            ahead = em.binary("arith.minui", em.binary("arith.addi", chunk, c(CHUNK), "nx"), last_chunk, "nx")
            return _chunk(em, k, v, rows(chunk, seq, head), rows(ahead, seq, head), queries, state, live, e, kv_elem)

        return em.if_(any_live, active, lambda: state, [s.type for s in state])

    state = em.for_(c(0), t, c(CHUNK), step, [ninf] * g + [fz] * g + [zero_e] * g, hint="c")
    for j in range(g):
        o = em.binary("arith.divf", state[2 * g + j], em.broadcast(state[g + j], ve, "l"), "o")
        if q_elem != "f32":
            o = em.cast("arith.truncf", o, vector(e, q_elem), "o")
        em.store(o, out, [row, heads[j], c(0)])


def _sequence_and_head(em: Emitter, wg: Value, kvh: int) -> tuple[Value, Value]:
    """A decode dispatch's workgroup ``wg``: its sequence (also its query row) and KV head."""
    return em.binary("arith.divui", wg, em.const(kvh), "b"), em.binary("arith.remui", wg, em.const(kvh), "h")


def _check(what: str, h: int, kvh: int, t: int, q_elem: str, kv_elem: str) -> None:
    if q_elem not in _FLOATS or kv_elem not in _FLOATS:
        raise ValueError(f"{what}: q and the cache must be one of {list(_FLOATS)}, found {q_elem} and {kv_elem}")
    if h % kvh or t % CHUNK:
        raise ValueError(f"{what}: expected query heads a multiple of KV heads and a cache length a multiple of {CHUNK}, found {h}, {kvh} and {t}")


def module_asm(b: int, h: int, t: int, kvh: int, e: int, q_elem: str, kv_elem: str, scale: float) -> str:
    """A module holding ``util.func @<function_name>(q: tensor<b x h x e x q_elem>, k, v:
    tensor<b x t x kvh x e x kv_elem>, mask: tensor<b x t x i8>) -> tensor<b x h x e x
    q_elem>``: for each sequence and query head, ``softmax(scale * q . k, masked) @ v`` over
    the cache entries whose mask byte is not 0, query head ``i`` attending with KV head ``i //
    (h // kvh)``. ``t``: a multiple of :data:`CHUNK`."""
    _check("decode attention", h, kvh, t, q_elem, kv_elem)
    q_op, kv_shape = Operand("q", (b, h, e), q_elem), (b, t, kvh, e)
    inputs = [q_op, Operand("k", kv_shape, kv_elem), Operand("v", kv_shape, kv_elem), Operand("mask", (b, t), "i8")]

    def body(em: Emitter, wg: Value, views: list[Value]) -> None:
        def rows(chunk: Value, seq: Value, head: Value) -> list[list[Value]]:
            return [[seq, em.binary("arith.addi", chunk, em.const(tt), "t"), head, em.const(0)] for tt in range(CHUNK)]

        q, k, v, mask, out = views
        seq, head = _sequence_and_head(em, wg, kvh)
        _walk(em, seq, seq, head, q, k, v, _mask_row(em, mask, seq), out, h=h, kvh=kvh, t=t, e=e, q_elem=q_elem, kv_elem=kv_elem, scale=scale, rows=rows)

    return executable(function_name(b, h, t, kvh, e, q_elem, kv_elem, scale), b * kvh, inputs, [q_op], body)


def paged_function_name(b: int, h: int, m: int, n: int, kvh: int, e: int, q_elem: str, kv_elem: str, scale: float) -> str:
    return f"sharktank_paged_decode_attention_{b}x{h}x{m}x{n}x{kvh}x{e}_{q_elem}_{kv_elem}_s{_bits(scale)}"


def _page_rows(em: Emitter, pages: Value, last: Value, n: int, columns: Value | None = None) -> Rows:
    """Rows through the page table: entry ``t`` of a sequence is slot ``t % n`` of page
    ``pages[seq, t // n]`` (clamped to ``last``, the pool's last page: a table entry past the
    pool reads a page of it, never past the buffer). A chunk reads the table once per page it
    touches, with static slots when its pages are whole (``n`` divides :data:`CHUNK`).
    ``columns``: the table is transposed (``pages[column, seq]``) and has that many columns,
    a column past them read as the last (its entries are never live)."""

    def page(seq: Value, column: Value) -> Value:
        if columns is None:
            at = [seq, column]
        else:
            at = [em.binary("arith.minui", column, em.binary("arith.subi", columns, em.const(1), "lastcol"), "col"), seq]
        got = em.cast("arith.index_cast", em.load_scalar(pages, at, "pg"), "index", "pg")
        return em.binary("arith.minui", got, last, "page")

    def rows(chunk: Value, seq: Value, head: Value) -> list[list[Value]]:
        zero, size = em.const(0), em.const(n)
        if CHUNK % n == 0:  # CHUNK // n whole pages
            first = em.binary("arith.divui", chunk, size, "col")
            held = [page(seq, first if j == 0 else em.binary("arith.addi", first, em.const(j), "col")) for j in range(CHUNK // n)]
            return [[held[tt // n], em.const(tt % n), head, zero] for tt in range(CHUNK)]
        if n % CHUNK == 0:  # the chunk inside one page
            held, slot = page(seq, em.binary("arith.divui", chunk, size, "col")), em.binary("arith.remui", chunk, size, "slot")
            return [[held, slot if tt == 0 else em.binary("arith.addi", slot, em.const(tt), "slot"), head, zero] for tt in range(CHUNK)]
        entries = [em.binary("arith.addi", chunk, em.const(tt), "t") for tt in range(CHUNK)]
        return [[page(seq, em.binary("arith.divui", t, size, "col")), em.binary("arith.remui", t, size, "slot"), head, zero] for t in entries]

    return rows


def _last_page(em: Emitter, k: Value, v: Value) -> Value:
    """The index of the last page both pools hold (a table entry past it reads this one)."""
    return em.binary("arith.subi", em.binary("arith.minui", em.dim(k, 0), em.dim(v, 0), "pool"), em.const(1), "last")


def paged_module_asm(b: int, h: int, m: int, n: int, kvh: int, e: int, q_elem: str, kv_elem: str, scale: float) -> str:
    """A module holding ``util.func @<paged_function_name>(q: tensor<b x h x e x q_elem>,
    k_pool, v_pool: tensor<? x n x kvh x e x kv_elem>, pages: tensor<b x m x i64>, mask:
    tensor<b x m*n x i8>) -> tensor<b x h x e x q_elem>``: :func:`module_asm`'s attention over
    each sequence's ``m`` pages of ``n`` entries, read from the pools (of any number of pages)
    through the page table ``pages`` (entry ``t`` of sequence ``s``: slot ``t % n`` of page
    ``pages[s, t // n]``). ``m * n``: a multiple of :data:`CHUNK`."""
    _check("paged decode attention", h, kvh, m * n, q_elem, kv_elem)
    q_op, pool = Operand("q", (b, h, e), q_elem), (None, n, kvh, e)
    inputs = [q_op, Operand("k", pool, kv_elem), Operand("v", pool, kv_elem), Operand("pages", (b, m), "i64"), Operand("mask", (b, m * n), "i8")]

    def body(em: Emitter, wg: Value, views: list[Value]) -> None:
        q, k, v, pages, mask, out = views
        seq, head = _sequence_and_head(em, wg, kvh)
        _walk(em, seq, seq, head, q, k, v, _mask_row(em, mask, seq), out, h=h, kvh=kvh, t=m * n, e=e, q_elem=q_elem, kv_elem=kv_elem, scale=scale,
              rows=_page_rows(em, pages, _last_page(em, k, v), n))

    return executable(paged_function_name(b, h, m, n, kvh, e, q_elem, kv_elem, scale), b * kvh, inputs, [q_op], body)


# Workgroups of the prefill dispatch per KV head: each takes every GROUPS-th query row.
GROUPS = 4


def paged_prefill_function_name(b: int, h: int, n: int, kvh: int, e: int, q_elem: str, kv_elem: str, scale: float) -> str:
    return f"sharktank_paged_prefill_attention_{b}x{h}x{n}x{kvh}x{e}_{q_elem}_{kv_elem}_s{_bits(scale)}"


def paged_prefill_module_asm(b: int, h: int, n: int, kvh: int, e: int, q_elem: str, kv_elem: str, scale: float) -> str:
    """A module holding ``util.func @<paged_prefill_function_name>(q: tensor<? x h x e x
    q_elem>, k_pool, v_pool: tensor<? x n x kvh x e x kv_elem>, pages: tensor<? x b x i64>,
    mask: tensor<? x i8>) -> tensor<? x h x e x q_elem>``: :func:`paged_module_asm`'s
    attention for each of the R query rows of ``q`` (R dynamic, a multiple of ``b``: rows
    ``s * R / b`` to ``(s + 1) * R / b - 1`` are sequence ``s``'s, a prompt chunk of ``R / b``
    tokens a sequence) over its sequence's ``M`` pages, the table transposed (``pages[j, s]``:
    sequence ``s``'s ``j``-th page; M dynamic) and the mask flat (row ``r``'s ``M * n``
    entries from ``r * M * n`` on: not 0 = attended, e.g. causally), ``M * n`` any number
    (the last chunk's entries past it are never live, its mask read padded). ``kvh`` *
    :data:`GROUPS` workgroups, one KV head each, taking every :data:`GROUPS`-th row."""
    _check("paged prefill attention", h, kvh, CHUNK, q_elem, kv_elem)
    q_op, pool = Operand("q", (None, h, e), q_elem), (None, n, kvh, e)
    inputs = [q_op, Operand("k", pool, kv_elem), Operand("v", pool, kv_elem), Operand("pages", (None, b), "i64"), Operand("mask", (None,), "i8")]

    def body(em: Emitter, wg: Value, views: list[Value]) -> None:
        q, k, v, pages, mask, out = views
        c = em.const
        group, head = em.binary("arith.divui", wg, c(kvh), "grp"), em.binary("arith.remui", wg, c(kvh), "h")
        count, columns = em.dim(q, 0, "rows"), em.dim(pages, 0, "cols")
        per_seq = em.binary("arith.divui", count, c(b), "per")
        length = em.binary("arith.muli", columns, c(n), "len")  # each row's mask: its sequence's entries
        covered = em.binary("arith.muli", em.binary("arith.divui", em.binary("arith.addi", length, c(CHUNK - 1), "up"), c(CHUNK), "up"), c(CHUNK), "cover")
        rows = _page_rows(em, pages, _last_page(em, k, v), n, columns)
        lanes, i64s = em.const(list(range(CHUNK)), vector(CHUNK, "i64")), vector(CHUNK, "i64")
        length_v = em.broadcast(em.cast("arith.index_cast", length, "i64", "len"), i64s, "li")
        zero, pad = c(0, vector(CHUNK, "i8")), c(0, "i8")

        def each(row: Value, _: list[Value]) -> None:
            seq = em.binary("arith.divui", row, per_seq, "b")
            base = em.binary("arith.muli", row, length, "mrow")

            def live(chunk: Value) -> Value:
                # The row's mask bytes of the chunk; those past its entries (the next row's,
                # or past the mask) count false.
                got = em.cmp("arith.cmpi", "ne", em.read_padded(mask, [em.binary("arith.addi", base, chunk, "mat")], vector(CHUNK, "i8"), pad, "mk"), zero, "set")
                first = em.broadcast(em.cast("arith.index_cast", chunk, "i64", "ci"), i64s, "ci")
                inside = em.cmp("arith.cmpi", "ult", em.binary("arith.addi", first, lanes, "ti"), length_v, "in")
                return em.binary("arith.andi", got, inside, "live")

            _walk(em, row, seq, head, q, k, v, live, out, h=h, kvh=kvh, t=covered, e=e, q_elem=q_elem, kv_elem=kv_elem, scale=scale, rows=rows)

        em.for_(group, count, c(GROUPS), each, hint="r")

    return executable(paged_prefill_function_name(b, h, n, kvh, e, q_elem, kv_elem, scale), kvh * GROUPS, inputs, [Operand("o", (None, h, e), q_elem, like=0)], body)
