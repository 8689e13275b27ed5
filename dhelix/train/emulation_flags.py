"""`--compute paced:CLUSTER[,x=F][,warm=W]` and `--emulate MODEL[,seq=S][,mbs=B][,dp=D]`
as plain data (`Emulation`), and the cluster they name; the pacing itself is
`emulate.py`."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


class EmulationError(ValueError):
    """A --compute / --emulate value that cannot be used; names the flag and the fix."""


@dataclass(frozen=True)
class Emulation:
    cluster: str                  # a40 | a800 | h100 | a YAML path
    factor: float = 1.0           # emulated time runs this many times slower than the cluster
    model: str = ""               # the emulated model config (name or YAML)
    seq_length: Optional[int] = None
    micro_batch_size: Optional[int] = None
    # the data-parallel size the gradient reduction is priced at (None: the run's own):
    # a run with DP cut to fit this machine still reduces as the published DP would
    data_parallel_size: Optional[int] = None
    # the factor of a run's first step, whose time is not kept (a warm-up): None, the
    # default, is min(factor, WARM_FACTOR); `warm` = `factor` paces it like the others
    warm: Optional[float] = None

    @property
    def warm_factor(self) -> float:
        return min(self.factor, WARM_FACTOR if self.warm is None else self.warm)


# the first step's default factor: ~4x less of it than a timed step at x=16..32, its ops
# late (the small ops' own cost is then a large share) but its time is not kept
WARM_FACTOR = 4.0


def parse(compute: str, emulate: str) -> Optional[Emulation]:
    """`paced:a40,x=4[,warm=W]` and `llama-8b,seq=4096,mbs=1[,dp=16]` -> an Emulation
    (None: not paced)."""
    compute = (compute or "none").strip()
    if compute == "none":
        return None
    m = re.fullmatch(r"paced:([^,]+)(?:,x=([\d.]+))?(?:,warm=([\d.]+))?", compute)
    if not m:
        raise EmulationError(f"--compute {compute!r}: use paced:CLUSTER[,x=FACTOR][,warm=W] "
                             f"(e.g. paced:a40,x=4), CLUSTER a40, a800, h100 or a cluster "
                             f"YAML, W the untimed first step's factor")
    factor = float(m.group(2) or 1.0)
    if factor < 1:
        raise EmulationError(f"--compute {compute!r}: x={factor:g} would ask the small ops "
                             f"to run faster than the cluster; give x >= 1")
    warm = float(m.group(3)) if m.group(3) else None
    if warm is not None and not 1 <= warm <= factor:
        raise EmulationError(f"--compute {compute!r}: warm={warm:g}: the first step's factor "
                             f"is between 1 and x={factor:g}")
    parts = [p.strip() for p in (emulate or "").split(",") if p.strip()]
    if not parts or "=" in parts[0]:
        raise EmulationError("--compute paced:... needs --emulate MODEL[,seq=S][,mbs=B][,dp=D]: "
                             "the model shape whose time the ranks keep (e.g. llama-8b)")
    opts = {}
    for p in parts[1:]:
        k, _, v = p.partition("=")
        if k not in ("seq", "mbs", "dp") or not v.isdigit() or int(v) < 1:
            raise EmulationError(f"--emulate {emulate!r}: {p!r}: use seq=S, mbs=B and dp=D "
                                 f"(the DP size the gradient reduction is priced at), "
                                 f"positive integers")
        opts[k] = int(v)
    return Emulation(m.group(1), factor, parts[0], opts.get("seq"), opts.get("mbs"),
                     opts.get("dp"), warm)


def _cluster(name: str) -> dict:
    """A cluster by name (configs/clusters/NAME.yaml) or YAML path."""
    from dhelix.models.config import find_named_yaml
    from dhelix.planner.costmodel import load_cluster
    return load_cluster(find_named_yaml(name, "clusters", f"--compute paced:{name}",
                                        "cluster", EmulationError))
