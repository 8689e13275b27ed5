"""Where megatron-core's API moved between the releases DHelix supports (0.15 to 0.19).

The one place that knows which megatron-core is installed; the rest of DHelix asks here
instead of checking versions itself. Each entry names the release that changed it.
  - `VERSION`: the installed release as (major, minor, patch).
  - `mlp_spec(num_experts)`: megatron's local dense or MoE MLP spec in the form the
    release wants. From 0.19 a layer's `mlp` is a builder (`MLP.as_mlp_submodule`,
    `partial(MoELayer, ...)`); a `ModuleSpec(module=MLP)` still works there but is
    rewrapped with a deprecation warning on every layer. `build(spec, **kw)` builds
    either form.
  - `spec_class(spec)`: the module class a spec builds, whatever form it has
    (`ModuleSpec`, a class, or 0.19's `functools.partial` builders, such as
    `partial(MoELayer, submodules=...)` and `partial(MLP.as_mlp_submodule, ...)`).
  - `spec_submodules(spec)`: the submodules a spec builds with, in any of those forms.
  - `load_common_state_dict(dir)`, `load_checkpoint(state, dir)`: read a torch_dist save
    of either format (0.16 writes `common.pt`; 0.19 keeps that state inside the torch_dist
    files and reads both), so a save crosses the releases both ways.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Any, Optional, Tuple


def _parse(version: str) -> Tuple[int, int, int]:
    # megatron appends '+<git hash>' when it lies in a git checkout; pre-releases 'rc0'
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", version)
    if not m:
        raise RuntimeError(f"megatron-core reports version {version!r}: not major.minor.patch")
    return tuple(int(x) for x in m.groups())


def _installed() -> Tuple[int, int, int]:
    from megatron.core import package_info
    return _parse(getattr(package_info, "__shortversion__", package_info.__version__))


VERSION: Tuple[int, int, int] = _installed()
# A test run that must be on one release (CI's 0.19.2 set) names it here, so a process
# that picked up another megatron-core fails at once instead of testing the wrong one.
_EXPECT = os.environ.get("DHELIX_EXPECT_MCORE")
if _EXPECT and _parse(_EXPECT) != VERSION:
    import megatron.core
    raise RuntimeError(f"DHELIX_EXPECT_MCORE={_EXPECT}, but this process imported megatron-core "
                       f"{'.'.join(map(str, VERSION))} from {megatron.core.__file__} (is the "
                       f"folder of scripts/install_megatron_core.py first on PYTHONPATH?)")
# the releases the test suite runs on (README "Install"); setup.py admits this range
TESTED = ((0, 16, 1), (0, 19, 2))
SUPPORTED = ((0, 15, 0), (0, 20, 0))        # [low, high)


def version_string() -> str:
    return ".".join(map(str, VERSION))


def mlp_spec(num_experts: Optional[int] = None) -> Any:
    """megatron's own local-module MLP (dense, or its MoE block with `num_experts`) in
    the form this release builds it: a `ModuleSpec` up to 0.16, a builder (`partial`)
    from 0.19 (`MLP.as_mlp_submodule`; `partial(MoELayer, ...)`)."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.models.gpt.gpt_layer_specs import get_mlp_module_spec_for_backend
    return get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts=num_experts,
                                           moe_grouped_gemm=False)


def build(spec, **kwargs):
    """Build a module from a spec in either form (0.19's builders are plain callables)."""
    from megatron.core.transformer.spec_utils import ModuleSpec, build_module
    if isinstance(spec, (ModuleSpec, type)):
        return build_module(spec, **kwargs)
    return spec(**kwargs)


def _target(spec):
    """What a spec finally calls: a ModuleSpec's module, a partial's function."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    while True:
        if isinstance(spec, ModuleSpec):
            spec = spec.module
        elif isinstance(spec, functools.partial):
            spec = spec.func
        else:
            return spec


def spec_class(spec) -> Optional[type]:
    """The module class `spec` builds (None where it is not a class: a function)."""
    t = _target(spec)
    if isinstance(t, type):
        return t
    owner = getattr(t, "__self__", None)          # a bound classmethod: MLP.as_mlp_submodule
    return owner if isinstance(owner, type) else None


def spec_submodules(spec) -> Any:
    """The submodules `spec` builds its module with (None where it has none)."""
    from megatron.core.transformer.spec_utils import ModuleSpec
    if isinstance(spec, ModuleSpec):
        return spec.submodules
    if isinstance(spec, functools.partial):
        return spec.keywords.get("submodules")
    return None


# ---- checkpoints ----------------------------------------------------------------------
# Up to 0.16 a torch_dist save keeps its common (non-tensor) state in `common.pt`; from
# 0.19 it is one ShardedObject, "common_state", inside the torch_dist files, and 0.19 reads
# both. The reader below lets an older release read a 0.19 save too.

def _embedded_common_state(checkpoint_dir: str):
    import io

    import torch
    from torch.distributed import checkpoint as dcp
    key = "common_state/shard_0_1"      # ShardedObject("common_state", None, (1,), (0,))
    out = {key: io.BytesIO()}
    dcp.load(out, storage_reader=dcp.FileSystemReader(checkpoint_dir), no_dist=True)
    value = out[key]
    if isinstance(value, io.BytesIO):
        value.seek(0)
        value = torch.load(value, weights_only=False)
    return value[0] if isinstance(value, (list, tuple)) else value


def _has_common_pt(checkpoint_dir) -> bool:
    return os.path.exists(os.path.join(str(checkpoint_dir), "common.pt"))


def load_common_state_dict(checkpoint_dir: str):
    """The common state of a torch_dist save of either format."""
    from megatron.core import dist_checkpointing
    if _has_common_pt(checkpoint_dir) or VERSION >= (0, 19, 0):
        return dist_checkpointing.load_common_state_dict(str(checkpoint_dir))
    return _embedded_common_state(str(checkpoint_dir))


def load_checkpoint(sharded_state_dict, checkpoint_dir: str):
    """`dist_checkpointing.load` of a save of either format: megatron's own from 0.19,
    which reads both; before it with megatron's torch common strategy taught 0.19's."""
    from megatron.core import dist_checkpointing
    if VERSION >= (0, 19, 0):
        return dist_checkpointing.load(sharded_state_dict, checkpoint_dir)
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class EitherFormat(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            if _has_common_pt(checkpoint_dir):
                return super().load_common(checkpoint_dir)
            return _embedded_common_state(str(checkpoint_dir))

    return dist_checkpointing.load(sharded_state_dict, checkpoint_dir,
                                   common_strategy=EitherFormat())
