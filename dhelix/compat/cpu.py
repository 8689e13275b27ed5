"""The few CUDA assumptions of megatron-core, met on CPU (DESIGN §4 (c), (d)).

Applied only when the process does not compute on CUDA (`base.hardware.uses_cuda`: no
device, or DHELIX_FORCE_CPU=1 as the test ranks set: on a GPU machine a CPU rank still
sees CUDA, and megatron would put its buffers there beside a CPU model), by `apply()`;
nothing else in DHelix patches megatron.
  (c) megatron allocates gather / all-to-all / grad buffers on `torch.cuda.current_device()`:
      inside those modules only, `torch.cuda.current_device()` answers "cpu".
  (f) the MoE all-to-all dispatcher's side stream (see `_NoStream`); with
      DHELIX_LANES=strict its device-to-host copies stay poison until their event is
      synchronized, as on CUDA (`_D2HEvent`).
  (g) the MoE router's GEMM without Transformer Engine (`_moe_router_without_te`).
  (h) context parallel: the RoPE table's slice for this CP rank (`_cp_rope_slice_on_host`).
  (d) the model-parallel RNG tracker keeps CUDA generator states: a tracker with the same
      interface keeps CPU generator states instead, seeded by
      `model_parallel_cuda_manual_seed` as usual.
  (i) activation recompute (`tensor_parallel.checkpoint`) saves and restores the CUDA
      generator's state beside the CPU one and the tracker's: there is none on CPU
      (`_no_cuda_rng_state`).
  (j) megatron's optimizers check that every parameter is a `torch.cuda.*Tensor`
      (`param.type()`, when built and in the grad norm): `cuda_type_names()` answers so
      for CPU tensors while one is built or steps (`train/optim.py`); its buffers and
      flags are allocated on `torch.cuda.current_device()`, as in (c).
  (k) dist_checkpointing (checkpoints, `train/checkpoint.py`) waits for the device before
      copying tensors to host (`torch.cuda.synchronize()`: nothing to wait for on CPU)
      and broadcasts its failure flags on `torch.cuda.current_device()`, as in (c).
  (l) megatron's checkpoint writer hands its write results back through a queue served by
      a spawned Manager process, made for asynchronous saves; that process outlives a
      rank killed or terminated mid-run and keeps the launcher's pipes open. DHelix saves
      synchronously (in the saving process), so a plain in-process queue carries them
      (`_in_process_write_results`, on any device, like (g)).
"""
from __future__ import annotations

import contextlib
import types
import weakref

import torch

from dhelix.base.hardware import uses_cuda
from dhelix.base.strict import strict

_APPLIED = False

# megatron modules whose buffers are allocated with torch.cuda.current_device()
_BUFFER_MODULES = (
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.distributed.param_and_grad_buffer",
    "megatron.core.distributed.distributed_data_parallel",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.utils",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.models.common.embeddings.rotary_pos_embedding",
    "megatron.core.transformer.utils",          # the local attention's causal mask
    "megatron.core.transformer.moe.token_dispatcher",   # (f) its side stream, below
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.optimizer.optimizer",          # (j) the optimizer's flags and norms
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",   # (k)
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
)


# (f) strict: what a host count copied from the device holds until its copy is known
# done: negative, so any split of it fails; not int64's min, which torch's SymInt takes
# for a symbolic value ("expected to contain only concrete integers")
D2H_POISON = -(1 << 40)

_d2h_copies: list = []              # made on the dtoh stream, no event recorded after yet
_d2h_events: "weakref.WeakSet" = weakref.WeakSet()     # recorded, not yet synchronized


def _poison(dtype):
    if dtype == torch.bool:
        return None                 # nothing reads as wrong: delivered at once
    if dtype.is_floating_point:
        return float("nan")
    return D2H_POISON if dtype == torch.int64 else torch.iinfo(dtype).min


def _d2h_copy(t: torch.Tensor) -> torch.Tensor:
    """(f) strict: a non-blocking device-to-host copy of `t`. On CUDA the host buffer
    holds the values only once the copy's stream has reached them, i.e. after the event
    recorded behind the copy is synchronized; until then it reads as poison here."""
    value = t.detach().clone()
    bad = _poison(value.dtype)
    if bad is None:
        return value
    host = torch.full_like(value, bad)
    _d2h_copies.append((host, value))
    return host


class _D2HEvent:
    """(f) strict: the event recorded after device-to-host copies. `synchronize()`
    delivers their values in place (megatron keeps the arrays and tensors it got)."""

    def __init__(self, copies):
        self._copies = copies
        _d2h_events.add(self)

    def query(self):
        return not self._copies

    def synchronize(self):
        for host, value in self._copies:
            host.copy_(value)
        self._copies = []
        _d2h_events.discard(self)


class _NoStream:
    """(f) The MoE all-to-all dispatcher copies routing counts to the host on a side CUDA
    stream; on CPU there is one stream: this one, which synchronises trivially — except
    in strict mode, where copies made on it wait for their event (`_D2HEvent`)."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other):
        pass

    def synchronize(self):
        for ev in list(_d2h_events):
            ev.synchronize()
        for host, value in _take_d2h_copies():
            host.copy_(value)

    def record_event(self):
        copies = _take_d2h_copies()
        if copies:
            return _D2HEvent(copies)
        return self                 # an event that is always complete: synchronize() no-op

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    __hash__ = object.__hash__


def _take_d2h_copies() -> list:
    copies = list(_d2h_copies)
    _d2h_copies.clear()
    return copies


_FACTORIES = ("zeros", "ones", "empty", "full", "tensor", "arange")


class _CpuCuda(types.SimpleNamespace):
    """Stands in for `torch.cuda` inside the patched modules."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"

    @staticmethod
    def is_available():
        return False

    @staticmethod
    def synchronize(*a, **k):        # (k) host and "device" are one: nothing pending
        return None

    Stream = _NoStream

    @staticmethod
    def current_stream(*a, **k):
        return _NoStream()

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()


class _TorchView(types.ModuleType):
    """`torch` as seen by one patched module: everything but `.cuda` is the real torch."""

    def __init__(self):
        super().__init__("torch")
        self.cuda = _CpuCuda()

    def __getattr__(self, name):
        fn = getattr(torch, name)
        if name in _FACTORIES:
            def on_cpu(*args, **kwargs):
                if str(kwargs.get("device", "")).startswith("cuda"):
                    kwargs["device"] = "cpu"
                return fn(*args, **kwargs)
            return on_cpu
        return fn


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mrandom

    class CpuRNGStatesTracker(mrandom.CudaRNGStatesTracker):
        """Model-parallel RNG tracker over CPU generator states."""

        def add(self, name, seed):
            if seed in self.seeds_:
                raise Exception(f"seed {seed} already exists")
            self.seeds_.add(seed)
            if name in self.states_:
                raise Exception(f"rng state {name} already exists")
            orig = torch.get_rng_state()
            torch.manual_seed(seed)
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(orig)

        @contextlib.contextmanager
        def fork(self, name=mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            if name not in self.states_:
                raise Exception(f"rng state {name} is not added")
            orig = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(orig)

    return CpuRNGStatesTracker


def _cpu_embedding_sync() -> None:
    """(e) With pipeline stages and tied embeddings, megatron copies the embedding to the
    last stage's output layer by an all-reduce of `weight.data.cuda()`: on CPU, inside that
    one method, `.cuda()` leaves the tensor where it is."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    orig = LanguageModule.setup_embeddings_and_output_layer

    def setup(self, *a, **k):
        cuda = torch.Tensor.cuda
        torch.Tensor.cuda = lambda t, *args, **kw: t
        try:
            return orig(self, *a, **k)
        finally:
            torch.Tensor.cuda = cuda
    LanguageModule.setup_embeddings_and_output_layer = setup


def _moe_router_without_te() -> None:
    """(g) megatron-core 0.16.1's router GEMM reads `te_general_gemm`, a name bound only
    when Transformer Engine imports; without TE it is a NameError. None is what the
    function's own fallback test expects."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _moe_split_sizes_on_host() -> None:
    from megatron.core.transformer.moe import moe_utils, token_dispatcher
    # (f) the all-to-all split sizes become host numbers when copied from the GPU; on CPU
    # nothing is copied and they stayed tensors, which all_to_all_single refuses
    orig = moe_utils.maybe_move_tensor_to_cpu

    def to_host(tensor, as_numpy=False, record_stream=False):
        # called only at the dispatcher's dtoh point, on its dtoh stream: in strict mode
        # the host copy is poison until the event recorded after it is synchronized
        if strict() and torch.is_tensor(tensor) and not tensor.is_cuda:
            tensor = _d2h_copy(tensor)
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return orig(tensor, as_numpy=as_numpy, record_stream=record_stream)
    token_dispatcher.maybe_move_tensor_to_cpu = to_host


def _cp_rope_slice_on_host() -> None:
    """(h) megatron slices the rotary table for a CP rank with an index tensor it pins and
    moves with `.cuda()`: on CPU the same slice (chunks r and 2C−1−r of 2C) by views."""
    from megatron.core.models.common.embeddings import rope_utils, rotary_pos_embedding

    def on_this_cp_rank(pos_emb, seq_dim, cp_group):
        c, r = cp_group.size(), cp_group.rank()
        chunks = pos_emb.chunk(2 * c, dim=seq_dim)
        return torch.cat((chunks[r], chunks[2 * c - 1 - r]), dim=seq_dim)
    for mod in (rope_utils, rotary_pos_embedding):
        mod.get_pos_emb_on_this_cp_rank = on_this_cp_rank


_CUDA_TYPE = {"torch.FloatTensor": "torch.cuda.FloatTensor",
              "torch.HalfTensor": "torch.cuda.HalfTensor",
              "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}


@contextlib.contextmanager
def cuda_type_names():
    """(j) While megatron builds an optimizer on CPU: `t.type()` of a CPU float tensor
    names its CUDA type, the only kind megatron's optimizers wrap. Nothing on CUDA."""
    if uses_cuda():
        yield
        return
    real = torch.Tensor.type

    def type_(self, *args, **kwargs):
        name = real(self, *args, **kwargs)
        return _CUDA_TYPE.get(name, name) if not args and not kwargs else name
    torch.Tensor.type = type_
    try:
        yield
    finally:
        torch.Tensor.type = real


def _no_cuda_rng_state() -> None:
    """(i) megatron's checkpoint (`_get_all_rng_states` / `_set_all_rng_states`, used by
    full and selective recompute) reads and sets the CUDA generator's state; on CPU there
    is no such generator: its state is None and setting it does nothing. The CPU
    generator's state and the tracker's (CPU states, (d)) are still saved and restored."""
    from megatron.core.tensor_parallel import random as mrandom
    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def _in_process_write_results() -> None:
    """(l)"""
    import queue
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()


def apply() -> bool:
    """Patch megatron for CPU if CUDA is absent. Returns True if patches are in place.
    (g) and (l) hold on any device: always applied."""
    global _APPLIED
    _moe_router_without_te()
    _in_process_write_results()
    if uses_cuda():
        return False
    if _APPLIED:
        return True
    import importlib

    view = _TorchView()
    for modname in _BUFFER_MODULES:
        mod = importlib.import_module(modname)
        if getattr(mod, "torch", None) is torch:
            mod.torch = view
    from megatron.core.tensor_parallel import random as mrandom

    tracker_cls = _cpu_tracker_class()
    mrandom._CUDA_RNG_STATE_TRACKER = tracker_cls()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    # `initialize_rng_tracker(force_reset=True)` would build a CUDA tracker again
    mrandom.CudaRNGStatesTracker = tracker_cls
    _cpu_embedding_sync()
    _moe_split_sizes_on_host()
    _cp_rope_slice_on_host()
    _no_cuda_rng_state()
    _APPLIED = True
    return True


def is_applied() -> bool:
    return _APPLIED
