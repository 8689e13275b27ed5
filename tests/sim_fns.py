"""Small layers, tables and plans the simulator tests share."""
from dhelix.planner.costs import CostTable
from dhelix.planner.opspec import COMM, COMPUTE, LayerOps, OpSpec
from dhelix.planner.plan import Plan, Step


def two_op_layer(f_lane="compute", b_lane="intra"):
    def op(name, lane, **kw):
        kind = COMPUTE if lane == "compute" else COMM
        grp = None if lane == "compute" else ("tp" if name.startswith("f") else "dp")
        return OpSpec(name, kind, lane, group=grp, **kw)
    return LayerOps([op("f", f_lane, saved_bytes=100, temp_bytes=10)],
                    [op("b", b_lane, saved_bytes=40, temp_bytes=5)])


def table_for(layer, tf, tb, p):
    t = CostTable.empty(layer)
    t.alone_f["f"], t.alone_b["b"], t.pair[("f", "b")] = tf, tb, p
    return t


def paired(layer):
    return Plan(layer.signature(), ["f"], ["b"], [Step(["f"], ["b"])])
