"""The pairwise cost table of DESIGN §1.4: op times alone and forward/backward pairs together.

A `CostTable` is plain data.  For one layer (identified by `LayerOps.signature()`) it holds

* ``alone_f[name]`` -- seconds for forward op ``name`` run alone,
* ``alone_b[name]`` -- seconds for backward op ``name`` run alone,
* ``pair[(f, b)]``  -- seconds from launching forward op ``f`` and backward op ``b``
  together until both are done,
* optionally ``in_step_f[name]`` / ``in_step_b[name]`` -- seconds of a compute op measured
  inside a whole layer step (its inputs just produced by the ops before it, the other
  strand's tensors alive), which the simulator takes as the op's duration where given;
  the alone times stay the basis of the pairs' overlap factors,
* optionally ``host_f[name]`` / ``host_b[name]`` -- seconds of a comm op's own work on
  the thread that issues it (issuing it, and finishing it once its data is there; on the
  paced link also copying its bytes in and out), which the simulator charges to the
  thread when the op is issued; absent means 0 (on CUDA a launch does not hold the
  compute stream, so the profiler writes none there),

plus a free-form ``provenance`` dict that records what it was measured on (model shape,
dtype, parallel sizes, hardware, library versions, or "analytical" and the cluster file),
and optionally ``step_extras`` (`StepExtras`): the parts of a training step outside the
layers, measured by `dhelix profile` on the same ranks for the table's model config,
which the whole-step simulator (`planner.whole_step`) adds around the layers.

File format (JSON)::

    {"format": "dhelix.table", "version": 1,
     "signature": "<LayerOps.signature()>",
     "forward": [names...], "backward": [names...],
     "alone_f": {"qkv": 1.2e-3, ...}, "alone_b": {...},
     "pair": {"qkv": {"rs_mlp_b": 1.5e-3, ...}, ...},      # pair[f][b]
     "in_step_f": {...}, "in_step_b": {...},                # optional
     "host_f": {"ag_attn": 2.1e-4, ...}, "host_b": {...},   # optional, comm ops
     "step_extras": {"pre_fwd_s": ..., "pre_bwd_s": ..., "post_fwd_s": ...,
                     "post_bwd_s": ..., "optimizer_s": ..., "finalize_s": ...,
                     "zero_grad_s": ..., "num_layers": 16,
                     "data_parallel_size": 1},             # optional
     "provenance": {...}}

A table without ``step_extras`` (written before they were measured, or by the analytical
model) loads as before; ``CostTable.step_extras`` is then None. The extras take no part in
the layer signature: they describe the model around the layer, not the layer.

Every problem with a table file raises `TableError` naming the file and what is wrong.
"""
from __future__ import annotations

import csv
import json
import math
from dataclasses import dataclass, field, replace
from typing import Dict, List, Optional, Tuple

from dhelix.planner.opspec import LayerOps, OpSpec

TABLE_FORMAT = "dhelix.table"
TABLE_VERSION = 1


class TableError(ValueError):
    """A cost table that is missing entries, corrupt, or made for another layer."""


def concurrent(f: OpSpec, b: OpSpec) -> bool:
    """Whether forward op ``f`` and backward op ``b`` can actually run at the same time.

    Ops on the same lane serialize (one compute lane; one stream per comm lane), so the
    simulator never needs their pair entry.
    """
    return f.lane != b.lane


@dataclass
class StepExtras:
    """Seconds of the parts of a training step outside the DHelix layers, measured with
    megatron's modules of the model `dhelix train` builds (`profiler/step_extras.py`):

    * per micro-batch: the pre-process (embedding) forward and backward, and the
      post-process (final norm, output layer, loss) forward and backward;
    * per step: the optimizer step (the trainer's AdamW over every parameter of the
      whole model at the table's TP size, ``num_layers`` layers), the grad finalize
      (megatron's `finalize_model_grads`: the layernorm grads' all-reduce under SP, the DP
      reduction) and zeroing the grad buffers when the step starts.
    """
    pre_fwd_s: float
    pre_bwd_s: float
    post_fwd_s: float
    post_bwd_s: float
    optimizer_s: float
    finalize_s: float
    num_layers: int                 # layers of the model the optimizer step was timed on
    zero_grad_s: float = 0.0
    data_parallel_size: int = 1     # ranks the DP reduction spanned when measured

    SECONDS = ("pre_fwd_s", "pre_bwd_s", "post_fwd_s", "post_bwd_s", "optimizer_s",
               "finalize_s")

    def per_microbatch(self) -> float:
        """What one micro-batch adds outside the layers, forward and backward."""
        return self.pre_fwd_s + self.pre_bwd_s + self.post_fwd_s + self.post_bwd_s

    def per_step(self) -> float:
        """What one step adds once, whatever its micro-batch count."""
        return self.optimizer_s + self.finalize_s + self.zero_grad_s

    def to_json(self) -> dict:
        return {**{k: getattr(self, k) for k in self.SECONDS},
                "zero_grad_s": self.zero_grad_s, "num_layers": self.num_layers,
                "data_parallel_size": self.data_parallel_size}

    @staticmethod
    def from_json(d, source: str = "<table>") -> "StepExtras":
        if not isinstance(d, dict):
            raise TableError(f"{source}: field 'step_extras' must be an object")
        missing = [k for k in StepExtras.SECONDS + ("num_layers",) if k not in d]
        if missing:
            raise TableError(f"{source}: step_extras lacks {', '.join(missing)}; re-run "
                             f"`dhelix profile` to measure them again")
        kw = {k: _num(d[k], source, f"step_extras[{k}]") for k in StepExtras.SECONDS}
        kw["zero_grad_s"] = _num(d.get("zero_grad_s", 0.0), source, "step_extras[zero_grad_s]")
        for k, default in (("num_layers", None), ("data_parallel_size", 1)):
            v = d.get(k, default)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise TableError(f"{source}: entry step_extras[{k}] is {v!r}, not a count >= 1")
            kw[k] = v
        return StepExtras(**kw)


@dataclass
class CostTable:
    signature: str
    forward: List[str]
    backward: List[str]
    alone_f: Dict[str, float] = field(default_factory=dict)
    alone_b: Dict[str, float] = field(default_factory=dict)
    pair: Dict[Tuple[str, str], float] = field(default_factory=dict)
    provenance: Dict = field(default_factory=dict)
    in_step_f: Dict[str, float] = field(default_factory=dict)
    in_step_b: Dict[str, float] = field(default_factory=dict)
    step_extras: Optional[StepExtras] = None
    host_f: Dict[str, float] = field(default_factory=dict)
    host_b: Dict[str, float] = field(default_factory=dict)

    # ---- construction ---------------------------------------------------------------
    @staticmethod
    def empty(layer: LayerOps, provenance: Optional[Dict] = None) -> "CostTable":
        """A table for ``layer`` with no entries yet (the profiler fills it)."""
        return CostTable(layer.signature(), [o.name for o in layer.forward],
                         [o.name for o in layer.backward], {}, {}, {}, dict(provenance or {}))

    # ---- queries --------------------------------------------------------------------
    def oef(self, f: str, b: str) -> float:
        """Overlap effectiveness (T_f + T_b - P) / min(T_f, T_b); 1 = shorter op hidden."""
        tf, tb, p = self.alone_f[f], self.alone_b[b], self.pair[(f, b)]
        lo = min(tf, tb)
        if lo <= 0.0:
            return 1.0 if p <= max(tf, tb) else 0.0
        return (tf + tb - p) / lo

    def stretch(self, f: str, b: str) -> float:
        """Slow-down factor of both ops while they overlap, s = max(1, 2 - OEF).

        With both ops progressing at rate 1/s while they overlap and at rate 1 alone, two
        ops launched together finish exactly after P (the measured pair time) whenever
        P >= max(T_f, T_b); see `dhelix.planner.simulate`.
        """
        tf, tb, p = self.alone_f[f], self.alone_b[b], self.pair[(f, b)]
        lo = tf if tf < tb else tb
        hi = tb if tf < tb else tf
        if lo <= 0.0:
            return 1.0
        s = 1.0 + (p - hi) / lo
        return s if s > 1.0 else 1.0

    def missing(self, layer: Optional[LayerOps] = None, pairs: str = "all") -> List[str]:
        """Names of the entries this table lacks for ``layer`` (default: its own op lists).

        ``pairs="all"`` asks for every forward x backward pair; ``pairs="concurrent"`` only
        for pairs on different lanes (the only ones the simulator reads); ``pairs="none"``
        only for the alone times.  Entries read ``alone_f[qkv]``, ``pair[qkv, fc2_dgrad]``.
        """
        if pairs not in ("all", "concurrent", "none"):
            raise ValueError(f"pairs must be 'all', 'concurrent' or 'none', not {pairs!r}")
        if layer is not None:
            fwd, bwd = list(layer.forward), list(layer.backward)
            fnames, bnames = [o.name for o in fwd], [o.name for o in bwd]
        else:
            fwd = bwd = None
            fnames, bnames = list(self.forward), list(self.backward)
        out = [f"alone_f[{n}]" for n in fnames if not _ok(self.alone_f.get(n))]
        out += [f"alone_b[{n}]" for n in bnames if not _ok(self.alone_b.get(n))]
        if pairs == "none":
            return out
        for fi, fn in enumerate(fnames):
            for bi, bn in enumerate(bnames):
                if pairs == "concurrent" and fwd is not None and not concurrent(fwd[fi], bwd[bi]):
                    continue
                if not _ok(self.pair.get((fn, bn))):
                    out.append(f"pair[{fn}, {bn}]")
        return out

    def check(self, layer: LayerOps, source: str = "<table>", pairs: str = "all",
              force: bool = False) -> None:
        """Raise TableError if the table is for another layer (unless ``force``) or lacks
        entries for ``layer``."""
        if self.signature not in layer.tables_for() and not force:
            prov = ", ".join(f"{k}={v}" for k, v in sorted(self.provenance.items())
                             if not isinstance(v, (dict, list)))
            raise TableError(
                f"{source}: table was measured for layer signature {self.signature}"
                f"{' (' + prov + ')' if prov else ''}, this layer is {layer.signature()} "
                f"(different model shape, parallel sizes or dtype); re-profile, or force it")
        miss = self.missing(layer, pairs=pairs)
        if miss:
            shown = ", ".join(miss[:12]) + (f", ... ({len(miss)} in all)" if len(miss) > 12 else "")
            raise TableError(f"{source}: table lacks {len(miss)} entr"
                             f"{'y' if len(miss) == 1 else 'ies'}: {shown}")

    # ---- serialisation --------------------------------------------------------------
    def to_json(self) -> dict:
        nested: Dict[str, Dict[str, float]] = {}
        for (f, b), v in self.pair.items():
            nested.setdefault(f, {})[b] = v
        d = {"format": TABLE_FORMAT, "version": TABLE_VERSION, "signature": self.signature,
             "forward": list(self.forward), "backward": list(self.backward),
             "alone_f": dict(self.alone_f), "alone_b": dict(self.alone_b),
             "pair": nested, "in_step_f": dict(self.in_step_f),
             "in_step_b": dict(self.in_step_b)}
        if self.host_f or self.host_b:           # absent where not measured
            d["host_f"], d["host_b"] = dict(self.host_f), dict(self.host_b)
        if self.step_extras is not None:         # absent, not null: old readers ignore it
            d["step_extras"] = self.step_extras.to_json()
        d["provenance"] = self.provenance
        return d

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1, sort_keys=False)

    @staticmethod
    def from_json(d: dict, source: str = "<table>") -> "CostTable":
        if not isinstance(d, dict) or d.get("format") != TABLE_FORMAT:
            raise TableError(f"{source}: field 'format' must be '{TABLE_FORMAT}' "
                             f"(is this a DHelix cost table? make one with `dhelix profile`)")
        if d.get("version") != TABLE_VERSION:
            raise TableError(f"{source}: field 'version' is {d.get('version')!r}, this DHelix "
                             f"reads version {TABLE_VERSION}; re-create the table")
        for key in ("signature", "forward", "backward", "alone_f", "alone_b", "pair"):
            if key not in d:
                raise TableError(f"{source}: missing field '{key}'")
        if not isinstance(d["forward"], list) or not isinstance(d["backward"], list):
            raise TableError(f"{source}: fields 'forward' and 'backward' must be lists of op names")
        for key in ("alone_f", "alone_b", "pair"):
            if not isinstance(d[key], dict):
                raise TableError(f"{source}: field '{key}' must be an object")
        alone_f = {str(k): _num(v, source, f"alone_f[{k}]") for k, v in d["alone_f"].items()}
        alone_b = {str(k): _num(v, source, f"alone_b[{k}]") for k, v in d["alone_b"].items()}
        pair: Dict[Tuple[str, str], float] = {}
        for f, row in d["pair"].items():
            if not isinstance(row, dict):
                raise TableError(f"{source}: pair['{f}'] must be an object of backward op -> seconds")
            for b, v in row.items():
                pair[(str(f), str(b))] = _num(v, source, f"pair[{f}, {b}]")
        prov = d.get("provenance", {})
        if not isinstance(prov, dict):
            raise TableError(f"{source}: field 'provenance' must be an object")
        in_step = []
        for key in ("in_step_f", "in_step_b", "host_f", "host_b"):
            v = d.get(key, {})
            if not isinstance(v, dict):
                raise TableError(f"{source}: field '{key}' must be an object")
            in_step.append({str(k): _num(x, source, f"{key}[{k}]") for k, x in v.items()})
        extras = d.get("step_extras")
        if extras is not None:
            extras = StepExtras.from_json(extras, source)
        return CostTable(str(d["signature"]), [str(n) for n in d["forward"]],
                         [str(n) for n in d["backward"]], alone_f, alone_b, pair, prov,
                         in_step[0], in_step[1], extras, in_step[2], in_step[3])

    @staticmethod
    def load(path: str, layer: Optional[LayerOps] = None, pairs: str = "all",
             force: bool = False) -> "CostTable":
        """Read a table; with ``layer``, also check it (signature and missing entries)."""
        try:
            with open(path) as f:
                d = json.load(f)
        except FileNotFoundError:
            raise TableError(f"cost table file not found: {path} (make one with `dhelix profile`"
                             f" or from a cluster file with the analytical cost model)")
        except json.JSONDecodeError as e:
            raise TableError(f"{path}: not valid JSON ({e}); the file is truncated or corrupted")
        except UnicodeDecodeError as e:
            raise TableError(f"{path}: not a text file ({e}); the file is corrupted")
        t = CostTable.from_json(d, source=path)
        if layer is not None:
            t.check(layer, source=path, pairs=pairs, force=force)
        return t

    def write_csv(self, path: str) -> None:
        """CSV view: one row per (forward, backward) pair with T_f, T_b, P and OEF."""
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["forward", "backward", "T_f_s", "T_b_s", "P_s", "OEF"])
            for fn in self.forward:
                for bn in self.backward:
                    tf, tb = self.alone_f.get(fn), self.alone_b.get(bn)
                    p = self.pair.get((fn, bn))
                    oef = self.oef(fn, bn) if None not in (tf, tb, p) else None
                    w.writerow([fn, bn, _fmt(tf), _fmt(tb), _fmt(p), _fmt(oef)])


def min_of_runs(tables: List["CostTable"], sources: Optional[List[str]] = None) -> "CostTable":
    """The tables of several profiling runs of one layer (separate rank processes) as
    one: every entry the smallest of the runs' medians. On CPU an op's time is only ever
    stretched by what else the machine does, and in some rank processes the same ops ran
    2-5x slower for a whole profile (their medians with them), so the minimum over
    processes is the op's own time; a plan made from such a stretched table ran 4-10%
    slower than one made from a clean table of the same link. Every run must hold the
    same layer and the same entries."""
    if not tables:
        raise TableError("no profiling runs to merge")
    names = sources or [f"run {k + 1}" for k in range(len(tables))]
    first = tables[0]
    for t, name in zip(tables[1:], names[1:]):
        if t.signature != first.signature:
            raise TableError(f"{name}: layer signature {t.signature}, {names[0]} has "
                             f"{first.signature}: the runs profiled different layers")
    fields = ("alone_f", "alone_b", "pair", "in_step_f", "in_step_b", "host_f", "host_b")
    merged = {}
    for fld in fields:
        keys = set(getattr(first, fld))
        for t, name in zip(tables[1:], names[1:]):
            if set(getattr(t, fld)) != keys:
                raise TableError(f"{name}: its {fld} entries differ from {names[0]}'s: the "
                                 f"runs measured different ops (other --pairs?)")
        merged[fld] = {k: min(getattr(t, fld)[k] for t in tables) for k in getattr(first, fld)}
    extras = first.step_extras
    if extras is not None:
        if any(t.step_extras is None for t in tables):
            raise TableError("some runs measured the step extras and some did not")
        extras = replace(extras, **{f: min(getattr(t.step_extras, f) for t in tables)
                                    for f in StepExtras.SECONDS + ("zero_grad_s",)})
    prov = dict(first.provenance, runs=len(tables),
                statistic="median per run, the minimum over runs")
    return CostTable(first.signature, list(first.forward), list(first.backward),
                     merged["alone_f"], merged["alone_b"], merged["pair"], prov,
                     merged["in_step_f"], merged["in_step_b"], extras,
                     merged["host_f"], merged["host_b"])


def merge_run_files(paths: List[str], out: str) -> Tuple["CostTable", List["CostTable"]]:
    """Read the runs' tables `paths`, write their `min_of_runs` to `out` (and its .csv
    view); returns (the merged table, the runs' tables)."""
    import os
    tables = [CostTable.load(p) for p in paths]
    merged = min_of_runs(tables, paths)
    merged.save(out)
    merged.write_csv(os.path.splitext(out)[0] + ".csv")
    return merged, tables


def _ok(v) -> bool:
    return v is not None and math.isfinite(v) and v >= 0.0


def _num(v, source: str, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TableError(f"{source}: entry {what} is {v!r}, not a number of seconds")
    v = float(v)
    if not math.isfinite(v) or v < 0.0:
        raise TableError(f"{source}: entry {what} is {v!r}, not a finite number of seconds >= 0")
    return v


def _fmt(v) -> str:
    return "" if v is None else repr(float(v))


__all__ = ["CostTable", "StepExtras", "TableError", "TABLE_FORMAT", "TABLE_VERSION", "concurrent",
           "merge_run_files", "min_of_runs"]
