"""The Q8_0 block product ``x @ dequantize(w).T`` as one hand-written CPU dispatch.

IREE 3.10's llvm-cpu code for the same product written in torch (``QuantizedTensor.product``)
is compute-bound: an 8192x2048 matvec took 1.2-1.4 ms (13-15 GB/s of block bytes), slower
than the bfloat16 product it should beat by reading half the bytes. This dispatch walks the
blocks as stored: per weight row, per 34-byte block, it loads the 32 int8 values and the
float16 scale, forms the 32 values once (``d * q``, in float32) and adds their products with
each row of ``x`` into per-row float32 accumulators of 32 lanes, summed at the row's end. The
same matvec takes 0.55-0.67 ms (about the machine's read bandwidth). Workgroups take
:data:`ROWS_PER_WORKGROUP` weight rows each.

The MLIR is plain ``scf``/``vector``/``memref`` inside a ``stream.executable`` (no external
object, no toolchain): IREE's CPU backend lowers it for the host like its own kernels. It is
a CPU dispatch only (a GPU would run it on one thread).
"""

from __future__ import annotations

ROWS_PER_WORKGROUP = 64
_BLOCK, _BYTES = 32, 34
_TYPES = {"f32": "f32", "bf16": "bf16", "f16": "f16"}


def function_name(m: int, n: int, k: int, elem: str) -> str:
    return f"sharktank_q8_0_product_{m}x{n}x{k}_{elem}"


def module_asm(m: int, n: int, k: int, elem: str) -> str:
    """A module holding ``util.func @<function_name>(x: tensor<m x k x elem>, blocks:
    tensor<n x k/32 x 34 x i8>) -> tensor<m x n x elem>`` and the dispatch it calls."""
    if elem not in _TYPES:
        raise ValueError(f"Q8_0 kernel: activations of type {elem} are not supported; expected one of {sorted(_TYPES)}")
    if k % _BLOCK:
        raise ValueError(f"Q8_0 kernel: K={k} is not a multiple of the block size {_BLOCK}")
    name, nb, t = function_name(m, n, k, elem), k // _BLOCK, ROWS_PER_WORKGROUP
    groups = -(-n // t)
    # A binding may start anywhere in the buffer stream packs it into: memrefs with a dynamic
    # offset, which the subspan's lowering fills in.
    x_t = f"memref<{m}x{k}x{elem}, strided<[{k}, 1], offset: ?>>"
    w_t = f"memref<{n}x{nb}x{_BYTES}xi8, strided<[{nb * _BYTES}, {_BYTES}, 1], offset: ?>>"
    y_t = f"memref<{m}x{n}x{elem}, strided<[{n}, 1], offset: ?>>"
    acc = "vector<32xf32>"
    rows = range(m)
    consts = "\n".join(f"      %r{i} = arith.constant {i} : index" for i in rows)
    inits = ", ".join(f"%a{i} = %zero" for i in rows)
    types = ", ".join([acc] * m)

    def load_x(i: int) -> str:
        load = f"%xl{i} = vector.load %x[%r{i}, %k] : {x_t}, vector<32x{elem}>"
        if elem == "f32":
            return load.replace(f"%xl{i}", f"%xv{i}")
        return f"{load}\n          %xv{i} = arith.extf %xl{i} : vector<32x{elem}> to {acc}"

    per_row = "\n".join(f"          {load_x(i)}\n          %u{i} = vector.fma %wv, %xv{i}, %a{i} : {acc}" for i in rows)
    yields = ", ".join(f"%u{i}" for i in rows)

    def store(i: int) -> str:
        s = f"%s{i} = vector.reduction <add>, %acc#{i} : {acc} into f32"
        v = f"%s{i}"
        if elem != "f32":
            s += f"\n        %t{i} = arith.truncf %s{i} : f32 to {elem}"
            v = f"%t{i}"
        return f"        {s}\n        memref.store {v}, %y[%r{i}, %row] : {y_t}"

    stores = "\n".join(store(i) for i in rows)
    return f"""module {{
stream.executable private @{name}_exe {{
  stream.executable.export public @{name} workgroups() -> (index, index, index) {{
    %g = arith.constant {groups} : index
    %one = arith.constant 1 : index
    stream.return %g, %one, %one : index, index, index
  }}
  builtin.module {{
    func.func @{name}(%xb: !stream.binding, %wb: !stream.binding, %yb: !stream.binding) {{
      %c0 = arith.constant 0 : index
      %c1 = arith.constant 1 : index
      %c2 = arith.constant 2 : index
      %c32 = arith.constant 32 : index
      %cn = arith.constant {n} : index
      %ct = arith.constant {t} : index
      %cnb = arith.constant {nb} : index
{consts}
      %zero = arith.constant dense<0.0> : {acc}
      %x = stream.binding.subspan %xb[%c0] : !stream.binding -> {x_t}
      %w = stream.binding.subspan %wb[%c0] : !stream.binding -> {w_t}
      %y = stream.binding.subspan %yb[%c0] : !stream.binding -> {y_t}
      %wg = stream.dispatch.workgroup.id[0] : index
      %first = arith.muli %wg, %ct : index
      %left = arith.subi %cn, %first : index
      %count = arith.minsi %ct, %left : index
      scf.for %i = %c0 to %count step %c1 {{
        %row = arith.addi %first, %i : index
        %acc:{m} = scf.for %b = %c0 to %cnb step %c1 iter_args({inits}) -> ({types}) {{
          %q = vector.load %w[%row, %b, %c2] : {w_t}, vector<32xi8>
          %qf = arith.sitofp %q : vector<32xi8> to {acc}
          %db = vector.load %w[%row, %b, %c0] : {w_t}, vector<2xi8>
          %dh = vector.bitcast %db : vector<2xi8> to vector<1xf16>
          %df = arith.extf %dh : vector<1xf16> to vector<1xf32>
          %d = vector.extract %df[0] : f32 from vector<1xf32>
          %ds = vector.broadcast %d : f32 to {acc}
          %wv = arith.mulf %qf, %ds : {acc}
          %k = arith.muli %b, %c32 : index
{per_row}
          scf.yield {yields} : {types}
        }}
{stores}
      }}
      return
    }}
  }}
}}
util.func private @{name}(%x: tensor<{m}x{k}x{elem}>, %w: tensor<{n}x{nb}x{_BYTES}xi8>) -> tensor<{m}x{n}x{elem}> {{
  %y = flow.dispatch @{name}_exe::@{name}(%x, %w) : (tensor<{m}x{k}x{elem}>, tensor<{n}x{nb}x{_BYTES}xi8>) -> tensor<{m}x{n}x{elem}>
  util.return %y : tensor<{m}x{n}x{elem}>
}}
}}
"""
