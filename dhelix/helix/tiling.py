"""Tiling: one graph becomes K tile streams along the batch dimension.

Every value of the graph gets a *batch layout*, propagated op by op from the inputs:
  SHARED         the same for every tile (parameters, and anything computed from them
                 alone): computed once
  Dim(d)         dimension d holds the K tiles as K equal contiguous blocks
  Ranks(n)       dimension 0 holds n rank blocks, each holding the K tiles (what an
                 all-gather of a Dim(0) value gives; a reduce-scatter takes it back)
  PARTIAL        the sum over tiles (a weight gradient: a contraction over the batch);
                 it is summed at once, so every later op sees a SHARED value
An op is copied once per tile only when a rule below proves that the copies, each on its
own tile, compute exactly the tiles of the untiled result. Anything else is refused with
the op's name (`TilingError`), never guessed.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch
import torch.fx as fx

aten = torch.ops.aten
c10d = torch.ops._c10d_functional


class TilingError(ValueError):
    """An op the tiling pass cannot prove safe to split."""


@dataclass(frozen=True)
class Dim:
    d: int


@dataclass(frozen=True)
class Ranks:
    n: int


SHARED, PARTIAL = "shared", "partial"

# ops whose output at every position depends on inputs at the same (broadcast) position
POINTWISE = {
    aten.add, aten.sub, aten.mul, aten.div, aten.neg, aten.gelu, aten.gelu_backward,
    aten.relu, aten.threshold_backward, aten.silu, aten.silu_backward, aten.sigmoid,
    aten.sigmoid_backward, aten.tanh, aten.tanh_backward, aten.rsqrt, aten.sqrt, aten.pow,
    aten.exp, aten.log, aten.where, aten.clone, aten._to_copy, aten.detach, aten.alias,
    aten.zeros_like, aten.ones_like, aten.empty_like, aten.full_like, aten.copy,
    aten.masked_fill, aten.lt, aten.le, aten.gt, aten.ge, aten.eq, aten.ne,
    aten.bitwise_or, aten.bitwise_and, aten.logical_or, aten.logical_and, aten.logical_not,
    aten.bitwise_not, aten.abs,
}
VIEWS = {aten.view, aten._unsafe_view, aten.reshape}
# ops whose result shares its argument's storage: an output made by one is rebuilt from
# its argument put back together (`tile`, output)
OUTPUT_VIEWS = {aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute,
                aten.detach, aten.alias, aten.split, aten.split_with_sizes, aten.unsqueeze,
                aten.squeeze, aten.slice, aten.select, aten.expand, operator.getitem}


def _packet(node: fx.Node):
    t = node.target
    return getattr(t, "overloadpacket", t)


def _shape(v) -> Optional[Sequence[int]]:
    val = v.meta.get("val") if isinstance(v, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


class Layouts:
    """The batch layout of every value of a graph (see the module doc)."""

    def __init__(self, graph: fx.Graph, inputs: Dict[str, object], k: int):
        self.k = k
        self.of: Dict[fx.Node, object] = {}
        for node in graph.nodes:
            if node.op == "placeholder":
                self.of[node] = inputs.get(node.name, SHARED)
            elif node.op == "call_function":
                self.of[node] = self._rule(node)

    def raw(self, a):
        return self.of.get(a, SHARED) if isinstance(a, fx.Node) else SHARED

    def get(self, a):
        """The layout a reader sees: a PARTIAL value is summed first, so it reads SHARED."""
        lay = self.raw(a)
        return SHARED if lay == PARTIAL else lay

    # ---- the rules ---------------------------------------------------------------------
    def _refuse(self, node, why):
        raise TilingError(f"tiling: cannot prove '{node.target}' ({node.name}) safe to split "
                          f"along the batch: {why}")

    def _rule(self, node: fx.Node):
        p = _packet(node)
        args = node.args
        tensors = [a for a in node.all_input_nodes]
        lays = [self.get(a) for a in tensors]
        if p is operator.getitem:
            lay = self.raw(args[0])
            return lay[args[1]] if isinstance(lay, tuple) else lay
        if all(l == SHARED for l in lays):
            return SHARED
        if p in POINTWISE:
            return self._pointwise(node, tensors, lays)
        if p in VIEWS:
            return self._view(node)
        if p in (aten.permute, aten.transpose, aten.t, aten.unsqueeze, aten.squeeze,
                 aten.expand):
            return self._move(node, p)
        if p in (aten.mm, aten.addmm, aten.bmm):
            return self._matmul(node, p)
        if p is aten.sum:
            return self._sum(node)
        if p is aten.native_layer_norm:
            d = self._dim_of(node, args[0])
            if d >= len(_shape(args[0])) - len(args[1]):
                self._refuse(node, "the batch dimension is normalised over")
            return (Dim(d), Dim(d), Dim(d))
        if p is aten.native_layer_norm_backward:
            d = self._dim_of(node, args[1])
            return (Dim(d), PARTIAL, PARTIAL)
        if p in (aten._softmax, aten._log_softmax):
            d = self._dim_of(node, args[0])
            if args[1] % len(_shape(args[0])) == d:
                self._refuse(node, "normalises over the batch dimension")
            return Dim(d)
        if p in (aten._softmax_backward_data, aten._log_softmax_backward_data):
            d = self._dim_of(node, args[0])
            if args[2] % len(_shape(args[0])) == d:
                self._refuse(node, "normalises over the batch dimension")
            return Dim(d)
        if p is aten.embedding:
            self._need(node, args[1], Dim(self._dim_of(node, args[1])), "looks up")
            if self.get(args[0]) != SHARED:
                self._refuse(node, "a batched embedding table")
            return Dim(self.get(args[1]).d)
        if p in (aten.slice, aten.select, aten.narrow):
            d = self._dim_of(node, args[0])
            nd = len(_shape(args[0]))
            dim = (args[1] if len(args) > 1 else 0) % nd
            if dim != d:
                return Dim(d if p is not aten.select or dim > d else d - 1)
            if p is aten.slice and _shape(node)[d] == _shape(args[0])[d]:
                return Dim(d)                 # the whole batch dimension: a no-op slice
            self._refuse(node, "takes part of the batch dimension")
        if p is aten.index_put:
            return self._masked_put(node)
        if p is aten.embedding_dense_backward:
            return PARTIAL                    # rows of the table summed over the tokens
        if p in (aten.split, aten.split_with_sizes, aten.chunk):
            return self._split(node, p)
        if p is aten.cat:
            return self._cat(node)
        if p is c10d.wait_tensor:
            return self.get(args[0])
        if p is c10d.all_gather_into_tensor:
            self._need(node, args[0], Dim(0), "gathers along dimension 0")
            return Ranks(int(args[1]))
        if p is c10d.reduce_scatter_tensor:
            self._need(node, args[0], Ranks(int(args[2])), "scatters rank blocks of dim 0")
            return Dim(0)
        if p is c10d.all_reduce:
            return self.get(args[0])
        self._refuse(node, "no tiling rule for this op")

    def _need(self, node, a, lay, what):
        if self.get(a) != lay:
            self._refuse(node, f"it {what}, its input's layout is {self.get(a)}")

    def _dim_of(self, node, a) -> int:
        lay = self.get(a)
        if not isinstance(lay, Dim):
            self._refuse(node, f"input {getattr(a, 'name', a)} has layout {lay}")
        return lay.d

    def _pointwise(self, node, tensors, lays):
        out = _shape(node)
        if out is None:
            self._refuse(node, "no shape recorded")
        dims = set()
        for a, lay in zip(tensors, lays):
            shp = _shape(a) or ()
            off = len(out) - len(shp)
            if isinstance(lay, Dim):
                dims.add(lay.d + off)
            elif lay == SHARED:
                continue
            else:
                self._refuse(node, f"input {a.name} has layout {lay}")
        if len(dims) != 1:
            self._refuse(node, f"inputs batched along different dimensions {sorted(dims)}")
        d = dims.pop()
        for a, lay in zip(tensors, lays):      # a shared operand must broadcast over tiles
            shp = _shape(a) or ()
            off = len(out) - len(shp)
            if lay == SHARED and d - off >= 0 and shp[d - off] != 1:
                self._refuse(node, f"shared input {a.name} varies along the batch dimension")
        return Dim(d)

    def _view(self, node):
        d = self._dim_of(node, node.args[0])
        src, out = _shape(node.args[0]), _shape(node)
        if any(s != 1 for s in src[:d]):
            self._refuse(node, "the batch dimension is not the outermost one")
        for i, s in enumerate(out):
            if s != 1:
                if s % self.k:
                    self._refuse(node, f"dimension {i} ({s}) does not split into {self.k}")
                return Dim(i)
        self._refuse(node, "no dimension left to hold the tiles")

    def _move(self, node, p):
        d = self._dim_of(node, node.args[0])
        nd = len(_shape(node.args[0]))
        if p is aten.permute:
            return Dim(list(a % nd for a in node.args[1]).index(d))
        if p is aten.t:
            return Dim(1 - d)
        if p is aten.transpose:
            a, b = (x % nd for x in node.args[1:3])
            return Dim(b if d == a else a if d == b else d)
        if p is aten.unsqueeze:
            k = node.args[1] % (nd + 1)
            return Dim(d + (k <= d))
        if p is aten.squeeze:
            dims = node.args[1] if len(node.args) > 1 else [
                i for i, s in enumerate(_shape(node.args[0])) if s == 1]
            dims = [x % nd for x in (dims if isinstance(dims, (list, tuple)) else [dims])]
            if d in dims:
                self._refuse(node, "squeezes the batch dimension")
            return Dim(d - sum(1 for x in dims if x < d))
        if _shape(node)[d + len(_shape(node)) - nd] != _shape(node.args[0])[d]:  # expand
            self._refuse(node, "expands the batch dimension")
        return Dim(d + len(_shape(node)) - nd)

    def _matmul(self, node, p):
        a, b = (node.args[1], node.args[2]) if p is aten.addmm else node.args[:2]
        la, lb = self.get(a), self.get(b)
        if p is aten.addmm and self.get(node.args[0]) != SHARED:
            self._refuse(node, "a batched bias")
        if p is aten.bmm:
            if la == lb == Dim(0):
                return Dim(0)
            self._refuse(node, f"bmm of layouts {la}, {lb}")
        if la == Dim(0) and lb == SHARED:
            return Dim(0)
        if la == SHARED and lb == Dim(1):
            return Dim(1)
        if la == Dim(1) and lb == Dim(0) and p is aten.mm:
            return PARTIAL                    # a contraction over the batch: sum of tiles
        self._refuse(node, f"matmul of layouts {la}, {lb}")

    def _sum(self, node):
        d = self._dim_of(node, node.args[0])
        nd = len(_shape(node.args[0]))
        if len(node.args) < 2 or node.args[1] is None:
            return PARTIAL
        dims = node.args[1] if isinstance(node.args[1], (list, tuple)) else [node.args[1]]
        dims = [x % nd for x in dims]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if d in dims:
            return PARTIAL
        return Dim(d if keep else d - sum(1 for x in dims if x < d))

    def _masked_put(self, node):
        """x[mask] = v with a boolean mask over x's leading dims, batched like x, and one
        shared value: each tile masks its own rows (DTensor's vocab-parallel embedding)."""
        x, idx, v = node.args[:3]
        d = self._dim_of(node, x)
        if len(idx) != 1 or not isinstance(idx[0], fx.Node):
            self._refuse(node, "indices other than one mask")
        mask = idx[0]
        mval, vval = mask.meta.get("val"), v.meta.get("val") if isinstance(v, fx.Node) else None
        if mval is None or mval.dtype != torch.bool or self.get(mask) != Dim(d) or \
                tuple(mval.shape) != tuple(_shape(x)[:mval.dim()]):
            self._refuse(node, "the index is not a boolean mask batched like the input")
        if self.get(v) != SHARED or (vval is not None and vval.numel() != 1):
            self._refuse(node, "the value put is not one shared scalar")
        return Dim(d)

    def _split(self, node, p):
        x = node.args[0]
        nd = len(_shape(x))
        dim = (node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % nd
        lay = self.get(x)
        parts = len(node.meta["val"])
        if isinstance(lay, Ranks) and dim == 0:
            if parts != lay.n:
                self._refuse(node, f"splits {lay.n} rank blocks into {parts}")
            return tuple(Dim(0) for _ in range(parts))
        d = self._dim_of(node, x)
        if dim == d:
            self._refuse(node, "splits the batch dimension")
        return tuple(Dim(d) for _ in range(parts))

    def _cat(self, node):
        parts = node.args[0]
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        lays = {self.get(a) for a in parts}
        if len(lays) != 1 or not isinstance(next(iter(lays)), Dim):
            self._refuse(node, f"cat of layouts {sorted(map(str, lays))}")
        d = next(iter(lays)).d
        dim %= len(_shape(parts[0]))
        if dim == d:
            if d != 0:
                self._refuse(node, "concatenates along the batch dimension")
            return Ranks(len(parts))         # rank blocks, as a reduce-scatter takes them
        return Dim(d)


# ---- building the tiled graph ------------------------------------------------------------
@dataclass
class Tiled:
    gm: fx.GraphModule
    stream: Dict[str, int]          # new node name -> tile stream (-1: shared)
    origin: Dict[str, str]          # new node name -> the original node it copies
    split_ops: int                  # original ops copied per tile
    shared_ops: int                 # original ops run once
    buckets: Dict[str, str] = field(default_factory=dict)   # original -> its bucket node
    concatenated: set = field(default_factory=set)    # nodes putting an output's tiles together
    segments: Dict[int, int] = field(default_factory=dict)  # stream -> segments (reorder)


def tile(gm: fx.GraphModule, inputs: Dict[str, object], k: int) -> Tiled:
    """The graph with each batched op copied once per tile; inputs (placeholder name ->
    layout) are cut into tiles, outputs put back together (tiles concatenated, partial
    sums summed), so the module's interface is unchanged."""
    lay = Layouts(gm.graph, inputs, k)
    g = fx.Graph()
    shared: Dict[fx.Node, fx.Node] = {}
    tiles: List[Dict[fx.Node, fx.Node]] = [dict() for _ in range(k)]
    summed: Dict[fx.Node, fx.Node] = {}
    stream: Dict[str, int] = {}
    origin: Dict[str, str] = {}
    n_split = n_shared = 0
    concatenated = set()

    def mark(new, s, old):
        stream[new.name] = s
        origin[new.name] = old.name
        return new

    def value(a, t):
        """What tile t (or None: the shared copy) reads for original value a."""
        if not isinstance(a, fx.Node):
            return a
        if lay.raw(a) == PARTIAL:
            return total(a)
        if a in shared:
            return shared[a]
        if t is None:
            raise TilingError(f"tiling: shared op reads batched value {a.name}")
        return tiles[t][a]

    def total(a):
        """A PARTIAL value summed over the tiles, once, in tile order."""
        if a not in summed:
            acc = tiles[0][a]
            for t in range(1, k):
                acc = g.call_function(aten.add.Tensor, (acc, tiles[t][a]))
                mark(acc, -1, a)
            summed[a] = acc
        return summed[a]

    def is_shared(a):
        return isinstance(a, fx.Node) and lay.raw(a) == SHARED

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            new = mark(g.placeholder(node.name), -1, node)
            new.meta = dict(node.meta)
            layout = lay.raw(node)
            if isinstance(layout, Dim):
                size = _shape(node)[layout.d]
                if size % k:
                    raise TilingError(f"tiling: input {node.name} has {size} along its batch "
                                      f"dimension {layout.d}, which does not split into "
                                      f"{k} tiles")
                for t in range(k):
                    tiles[t][node] = mark(g.call_function(
                        aten.slice.Tensor, (new, layout.d, t * size // k,
                                            (t + 1) * size // k)), t, node)
            else:
                shared[node] = new
        elif node.op == "get_attr":          # a constant of the module: shared
            new = g.get_attr(node.target)
            new.meta = dict(node.meta)
            shared[node] = mark(new, -1, node)
        elif node.op == "output":
            assembled: Dict[fx.Node, fx.Node] = {}

            def whole(a):
                """Original value `a` (batched) put back together once. A view of a batched
                value is that value put together and the original view applied to it, so
                outputs sharing a base in the program share it here too (concatenating
                each view would hold a copy of the base per view)."""
                if a not in assembled:
                    base = a.args[0] if a.args else None
                    if a.op == "call_function" and _packet(a) in OUTPUT_VIEWS and \
                            isinstance(base, fx.Node) and isinstance(lay.raw(base), Dim):
                        args = (whole(base),) + tuple(a.args[1:])
                        new = g.call_function(a.target, args, dict(a.kwargs))
                    else:
                        new = g.call_function(aten.cat.default,
                                              ([tiles[t][a] for t in range(k)],
                                               lay.raw(a).d))
                        concatenated.add(new.name)
                    assembled[a] = mark(new, -1, a)
                return assembled[a]

            def out(a):
                if not isinstance(a, fx.Node):
                    return a
                layout = lay.raw(a)
                if isinstance(layout, Dim) and k == 1:
                    return tiles[0][a]
                if isinstance(layout, Dim):
                    return whole(a)
                if isinstance(layout, Ranks):
                    raise TilingError(f"tiling: output {a.name} is rank-blocked")
                return value(a, None)
            g.output(fx.node.map_aggregate(node.args[0], out))
        else:
            layout = lay.raw(node)
            if layout == SHARED:
                new = g.call_function(node.target, *_map(node, lambda a: value(a, None)))
                new.meta = dict(node.meta)
                shared[node] = mark(new, -1, node)
                n_shared += 1
            else:
                fix = _tile_sizes(node, lay, k)
                for t in range(k):
                    args, kwargs = _map(
                        node, lambda a, t=t: value(a, t) if not is_shared(a) else shared[a])
                    new = g.call_function(node.target, fix(args), kwargs)
                    tiles[t][node] = mark(new, t, node)
                n_split += 1
    g.lint()
    out = fx.GraphModule(gm, g)
    propagate_shapes(out)
    return Tiled(out, stream, origin, n_split, n_shared, concatenated=concatenated)


def propagate_shapes(gm: fx.GraphModule) -> None:
    """Fake values (shape, dtype) for every node of the tiled graph, as AOT autograd
    recorded them for the original one: what the simulator sizes tensors by."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp
    vals = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    mode = next((v.fake_mode for v in vals if isinstance(v, FakeTensor)), None)
    if mode is None:
        return
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*vals)


def _map(node: fx.Node, fn):
    args = fx.node.map_aggregate(node.args, lambda a: fn(a) if isinstance(a, fx.Node) else a)
    kwargs = fx.node.map_aggregate(node.kwargs,
                                   lambda a: fn(a) if isinstance(a, fx.Node) else a)
    return args, kwargs


def _tile_sizes(node: fx.Node, lay: Layouts, k: int):
    """Size arguments that count along the batch become one tile's: a view's or expand's
    target shape, a split of rank blocks (each block holds K tiles)."""
    p = _packet(node)
    layout = lay.raw(node)
    if p in VIEWS or p is aten.expand:
        shape = list(_shape(node))
        shape[layout.d] //= k
        return lambda args: (args[0], shape) + tuple(args[2:])
    if p in (aten.split, aten.split_with_sizes) and isinstance(lay.get(node.args[0]), Ranks):
        size = node.args[1]
        size = [x // k for x in size] if isinstance(size, (list, tuple)) else size // k
        return lambda args: (args[0], size) + tuple(args[2:])
    return lambda args: args
