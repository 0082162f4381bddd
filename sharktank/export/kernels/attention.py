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
``g`` query heads: the 16 scores (``scale * q . k``, float32), their maximum, the running
maximum's correction of the sums so far (``exp(old - new)``, one per chunk), the 16 weights
``exp(score - max)`` (0 where the mask is false), and the weighted values added into a
float32 accumulator of ``head_dim`` lanes (a masked entry's values taken as 0: what a masked
entry holds never reaches the result, not even a NaN). The result is the accumulator over the weights'
sum: a softmax computed online, equal to the torch form up to float32 rounding.
"""

from __future__ import annotations

import struct

from .dispatch import _indent

__all__ = ["CHUNK", "function_name", "module_asm"]

CHUNK = 16  # cache entries per step of the walk (the mask of one chunk: one 16-byte load)
_FLOATS = ("f32", "bf16", "f16")


def _bits(scale: float) -> str:
    """The float32 bits of ``scale`` in hex: its MLIR literal, and its part of the name."""
    return struct.pack(">f", scale).hex().upper()


def function_name(b: int, h: int, t: int, kvh: int, e: int, q_elem: str, kv_elem: str, scale: float) -> str:
    return f"sharktank_decode_attention_{b}x{h}x{t}x{kvh}x{e}_{q_elem}_{kv_elem}_s{_bits(scale)}"


def _chunk(g: int, e: int, kv_elem: str, kv_t: str) -> str:
    """The body of an active chunk at ``%c`` (entries ``%c .. %c + 15``): from the running
    ``%m{j}``, ``%l{j}``, ``%a{j}`` to the yielded ``%mn{j}``, ``%ln{j}`` and (the last
    entry's) ``%a{j}_15``."""
    ve, v16 = f"vector<{e}xf32>", "vector<16xf32>"
    lines = []

    def row(cache: str, tt: int, name: str) -> None:
        load = f"vector.load %{cache}[%b, %t{tt}, %h, %c0] : {kv_t}, vector<{e}x{kv_elem}>"
        if kv_elem == "f32":
            lines.append(f"%{name}{tt} = {load}")
        else:
            lines.extend([f"%{name}{tt}_e = {load}", f"%{name}{tt} = arith.extf %{name}{tt}_e : vector<{e}x{kv_elem}> to {ve}"])

    for tt in range(CHUNK):
        lines += [f"%tt{tt} = arith.constant {tt} : index", f"%t{tt} = arith.addi %c, %tt{tt} : index"]
        row("k", tt, "kr")
        for j in range(g):
            lines += [f"%p{j}_{tt} = arith.mulf %q{j}, %kr{tt} : {ve}", f"%s{j}_{tt} = vector.reduction <add>, %p{j}_{tt} : {ve} into f32"]
    for j in range(g):
        lines += [
            f"%sv{j} = vector.from_elements {', '.join(f'%s{j}_{tt}' for tt in range(CHUNK))} : {v16}",
            f"%sm{j} = arith.select %live, %sv{j}, %ninf16 : vector<16xi1>, {v16}",
            f"%mc{j} = vector.reduction <maximumf>, %sm{j} : {v16} into f32",
            f"%mn{j} = arith.maximumf %m{j}, %mc{j} : f32",
            f"%dm{j} = arith.subf %m{j}, %mn{j} : f32",
            f"%cr{j} = math.exp %dm{j} : f32",  # 0 while the running maximum is -inf
            f"%mnv{j} = vector.broadcast %mn{j} : f32 to {v16}",
            f"%ds{j} = arith.subf %sm{j}, %mnv{j} : {v16}",
            f"%w{j} = math.exp %ds{j} : {v16}",  # 0 where masked
            f"%ws{j} = vector.reduction <add>, %w{j} : {v16} into f32",
            f"%lc{j} = arith.mulf %l{j}, %cr{j} : f32",
            f"%ln{j} = arith.addf %lc{j}, %ws{j} : f32",
            f"%crv{j} = vector.broadcast %cr{j} : f32 to {ve}",
            f"%a{j}_c = arith.mulf %a{j}, %crv{j} : {ve}",
        ]
    current = [f"%a{j}_c" for j in range(g)]
    for tt in range(CHUNK):
        row("v", tt, "vr")
        # A masked entry's values count 0 whatever they are (0 * NaN would be NaN).
        lines += [f"%lv{tt} = vector.extract %live[{tt}] : i1 from vector<16xi1>", f"%vz{tt} = arith.select %lv{tt}, %vr{tt}, %zero_e : {ve}"]
        for j in range(g):
            name = f"%a{j}_{tt}"
            lines += [
                f"%w{j}_{tt} = vector.extract %w{j}[{tt}] : f32 from {v16}",
                f"%wb{j}_{tt} = vector.broadcast %w{j}_{tt} : f32 to {ve}",
                f"{name} = vector.fma %wb{j}_{tt}, %vz{tt}, {current[j]} : {ve}",
            ]
            current[j] = name
    return "\n".join(lines)


def module_asm(b: int, h: int, t: int, kvh: int, e: int, q_elem: str, kv_elem: str, scale: float) -> str:
    """A module holding ``util.func @<function_name>(q: tensor<b x h x e x q_elem>, k, v:
    tensor<b x t x kvh x e x kv_elem>, mask: tensor<b x t x i8>) -> tensor<b x h x e x
    q_elem>``: for each sequence and query head, ``softmax(scale * q . k, masked) @ v`` over
    the cache entries whose mask byte is not 0, query head ``i`` attending with KV head ``i //
    (h // kvh)``. ``t``: a multiple of :data:`CHUNK`."""
    if q_elem not in _FLOATS or kv_elem not in _FLOATS:
        raise ValueError(f"decode attention: q and the cache must be one of {list(_FLOATS)}, found {q_elem} and {kv_elem}")
    if h % kvh or t % CHUNK:
        raise ValueError(f"decode attention: expected query heads a multiple of KV heads and a cache length a multiple of {CHUNK}, found {h}, {kvh} and {t}")
    g, name = h // kvh, function_name(b, h, t, kvh, e, q_elem, kv_elem, scale)
    ve = f"vector<{e}xf32>"
    q_t = f"memref<{b}x{h}x{e}x{q_elem}, strided<[{h * e}, {e}, 1], offset: ?>>"
    kv_t = f"memref<{b}x{t}x{kvh}x{e}x{kv_elem}, strided<[{t * kvh * e}, {kvh * e}, {e}, 1], offset: ?>>"
    m_t = f"memref<{b}x{t}xi8, strided<[{t}, 1], offset: ?>>"
    queries = []
    for j in range(g):
        load = f"vector.load %q[%b, %hq{j}, %c0] : {q_t}, vector<{e}x{q_elem}>"
        queries += [f"%jq{j} = arith.constant {j} : index", f"%hq{j} = arith.addi %h0, %jq{j} : index"]
        queries += [f"%qr{j} = {load}"] if q_elem == "f32" else [f"%qe{j} = {load}", f"%qr{j} = arith.extf %qe{j} : vector<{e}x{q_elem}> to {ve}"]
        queries.append(f"%q{j} = arith.mulf %qr{j}, %scalev : {ve}")
    state = [f"%m{j}" for j in range(g)] + [f"%l{j}" for j in range(g)] + [f"%a{j}" for j in range(g)]
    types = ["f32"] * (2 * g) + [ve] * g
    inits = ", ".join(f"{s} = {init}" for s, init in zip(state, ["%ninf"] * g + ["%fz"] * g + ["%zero_e"] * g))
    new = [f"%mn{j}" for j in range(g)] + [f"%ln{j}" for j in range(g)] + [f"%a{j}_{CHUNK - 1}" for j in range(g)]
    n = len(state)
    stores = []
    for j in range(g):
        stores += [f"%lv{j} = vector.broadcast %r#{g + j} : f32 to {ve}", f"%o{j} = arith.divf %r#{2 * g + j}, %lv{j} : {ve}"]
        out = f"%o{j}"
        if q_elem != "f32":
            stores.append(f"%ot{j} = arith.truncf %o{j} : {ve} to vector<{e}x{q_elem}>")
            out = f"%ot{j}"
        stores.append(f"vector.store {out}, %out[%b, %hq{j}, %c0] : {q_t}, vector<{e}x{q_elem}>")

    q_tensor, kv_tensor, m_tensor = f"tensor<{b}x{h}x{e}x{q_elem}>", f"tensor<{b}x{t}x{kvh}x{e}x{kv_elem}>", f"tensor<{b}x{t}xi8>"
    sig = ", ".join(types)
    return f"""module {{
stream.executable private @{name}_exe {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %g = arith.constant {b * kvh} : index
    %one = arith.constant 1 : index
    stream.return %g, %one, %one : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%qb: !stream.binding, %kb: !stream.binding, %vb: !stream.binding, %mb: !stream.binding, %ob: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c16 = arith.constant {CHUNK} : index
      %ct = arith.constant {t} : index
      %ckvh = arith.constant {kvh} : index
      %cg = arith.constant {g} : index
      %fz = arith.constant 0.0 : f32
      %ninf = arith.constant 0xFF800000 : f32
      %ninf16 = arith.constant dense<0xFF800000> : vector<16xf32>
      %zero_e = arith.constant dense<0.0> : {ve}
      %zero_m = arith.constant dense<0> : vector<16xi8>
      %scale = arith.constant 0x{_bits(scale)} : f32
      %scalev = vector.broadcast %scale : f32 to {ve}
      %q = stream.binding.subspan %qb[%c0] : !stream.binding -> {q_t}
      %k = stream.binding.subspan %kb[%c0] : !stream.binding -> {kv_t}
      %v = stream.binding.subspan %vb[%c0] : !stream.binding -> {kv_t}
      %mask = stream.binding.subspan %mb[%c0] : !stream.binding -> {m_t}
      %out = stream.binding.subspan %ob[%c0] : !stream.binding -> {q_t}
      %wg = stream.dispatch.workgroup.id[0] : index
      %b = arith.divui %wg, %ckvh : index
      %h = arith.remui %wg, %ckvh : index
      %h0 = arith.muli %h, %cg : index
{_indent(chr(10).join(queries), 6)}
      %r:{n} = scf.for %c = %c0 to %ct step %c16 iter_args({inits}) -> ({sig}) {{
        %mk = vector.load %mask[%b, %c] : {m_t}, vector<16xi8>
        %live = arith.cmpi ne, %mk, %zero_m : vector<16xi8>
        %any = vector.reduction <or>, %live : vector<16xi1> into i1
        %s:{n} = scf.if %any -> ({sig}) {{
{_indent(_chunk(g, e, kv_elem, kv_t), 10)}
          scf.yield {", ".join(new)} : {sig}
        }} else {{
          scf.yield {", ".join(state)} : {sig}
        }}
        scf.yield {", ".join(f"%s#{i}" for i in range(n))} : {sig}
      }}
{_indent(chr(10).join(stores), 6)}
      return
    }}
  }}
}}
util.func private @{name}(%q: {q_tensor}, %k: {kv_tensor}, %v: {kv_tensor}, %mask: {m_tensor}) -> {q_tensor} {{
  %o = flow.dispatch @{name}_exe::@{name}(%q, %k, %v, %mask) : ({q_tensor}, {kv_tensor}, {kv_tensor}, {m_tensor}) -> {q_tensor}
  util.return %o : {q_tensor}
}}
}}
"""
