"""What the profiler and the trainer measure, the same way on CPU and CUDA: op times (the
Tracer's clock), the layer the profiler builds, and activation memory per step.

No GPU here: the CUDA paths are tested with fake CUDA events and a fake allocator (the
real ones cannot run on CPU); the CPU paths run for real.
"""
import time

import pytest
import torch

from dhelix.base.memory import METER, StepMemory
from dhelix.planner.opspec import COMM, COMPUTE, OpSpec
from dhelix.strand.executor import execute_step
from dhelix.strand.lanes import CpuLanes, CudaLanes, Pending
from dhelix.strand.program import Op
from dhelix.strand.state import StrandState
from dhelix.strand.trace import CudaClock, HostClock, Tracer
from dhelix.testing import run_ranks
from train_fns import train_result


# -- op timing: fake CUDA ---------------------------------------------------------------------
class FakeDevice:
    """A device timeline: the compute stream's time, advanced by the ops' kernels."""

    def __init__(self):
        self.compute = 0.0
        self.synchronized = False


DEV = FakeDevice()


class FakeEvent:
    """torch.cuda.Event's timing interface: `record` stamps the compute stream's time."""

    def __init__(self, enable_timing=False, **_):
        self.timing, self.t = enable_timing, None

    def record(self, stream=None):
        self.t = DEV.compute

    def elapsed_time(self, end):
        if not (self.timing and end.timing):
            raise RuntimeError("Both events must be created with argument 'enable_timing=True'")
        assert DEV.synchronized, "events read before a synchronize"
        return (end.t - self.t) * 1e3


class FakeCudaLanes(CudaLanes):
    """CUDA lanes on the fake device: a comm starts when the compute stream reaches it and
    its lane's event fires `seconds` later; reading it makes the compute stream wait."""

    def __init__(self, timing=True):
        super().__init__()
        self.timing = timing

    def launch(self, op, seconds):
        ev = FakeEvent(enable_timing=self.timing)
        ev.t = DEV.compute + seconds
        return Pending(op, torch.zeros(1), ev)

    def resolve(self, p):
        if not p.done:
            DEV.compute = max(DEV.compute, p.handle.t)
            p.done = True
            p.t_done = time.perf_counter()
        return p.out


def _kernel(seconds):
    def run(S):
        DEV.compute += seconds      # the host returns at once: only a launch
    return run


def _chain(comm_s=10e-3):
    """f1 (2 ms) -> ag (comm, `comm_s`) -> f2 reads ag (3 ms)."""
    def ag(S):
        S.put("ag", S.lanes.launch("ag", comm_s))

    def f2(S):
        S.get("ag")
        _kernel(3e-3)(S)
    return [Op(OpSpec("f1", COMPUTE, "compute"), _kernel(2e-3)),
            Op(OpSpec("ag", COMM, "intra"), ag),
            Op(OpSpec("f2", COMPUTE, "compute"), f2)]


@pytest.fixture
def fake_cuda(monkeypatch):
    # torch.cuda cannot run here: its events and synchronize are replaced by fakes
    DEV.compute, DEV.synchronized = 0.1, False
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a: setattr(DEV, "synchronized", True))
    return DEV


def test_cuda_clock_times_ops_by_device_events(fake_cuda):
    S = StrandState(FakeCudaLanes(), "α", "F1")
    tracer = Tracer()                       # picks the clock by the lanes
    execute_step((S, _chain()), None, tracer)
    assert isinstance(tracer.clock, CudaClock)
    ev = {e.op: e for e in tracer.events}   # read: synchronizes, then converts
    assert fake_cuda.synchronized
    # device times from the first op's start, not host (launch) times
    assert ev["f1"].start == pytest.approx(0) and ev["f1"].end == pytest.approx(2e-3)
    assert (ev["ag"].lane, ev["ag"].start, ev["ag"].end) == \
        ("intra", pytest.approx(2e-3), pytest.approx(12e-3))
    # f2's kernels start when the comm it read is done, not when it was issued
    assert ev["f2"].start == pytest.approx(12e-3) and ev["f2"].end == pytest.approx(15e-3)
    assert {e.strand for e in ev.values()} == {"α"} and ev["f2"].label == "F1"


def test_cuda_clock_restarts_at_reset(fake_cuda):
    S = StrandState(FakeCudaLanes(), "α")
    tracer = Tracer()
    execute_step((S, _chain()), None, tracer)
    tracer.reset()
    fake_cuda.compute += 1.0                # another iteration, later
    S = StrandState(FakeCudaLanes(), "α")
    execute_step((S, _chain(comm_s=1e-3)), None, tracer)
    ev = {e.op: e for e in tracer.events}
    assert len(tracer.events) == 3
    assert ev["f1"].start == pytest.approx(1.0)      # t0: the reset, as on the host
    assert ev["f2"].end - ev["f2"].start == pytest.approx(3e-3)


def test_cuda_clock_needs_timed_lane_events(fake_cuda):
    """The CUDA clock reads the lanes' comm events, which CudaLanes create without timing
    unless traced: a tracer that picks the clock from the lanes turns their timing on
    first (the trace reads); one given a CUDA clock over untimed lanes fails, saying why."""
    lanes = FakeCudaLanes(timing=False)
    tracer = Tracer()
    execute_step((StrandState(lanes, "α"), _chain()), None, tracer)
    assert lanes.timing is True and len(tracer.events) == 3
    tracer = Tracer(clock=CudaClock())
    execute_step((StrandState(FakeCudaLanes(timing=False), "α"), _chain()), None, tracer)
    with pytest.raises(RuntimeError, match="enable_timing=True"):
        tracer.events


# -- op timing: the host clock on CPU (real) --------------------------------------------------
class _SlowWork:
    def __init__(self, seconds):
        self.seconds = seconds

    def wait(self):
        time.sleep(self.seconds)
        return True


class SlowCpuLanes(CpuLanes):
    def launch(self, op, seconds):
        return Pending(op, torch.zeros(1), _SlowWork(seconds))


def test_host_clock_on_cpu_lanes():
    """CPU: host time, a compute op counted from when the comm it read had arrived."""
    def sleep(s):
        return lambda S: time.sleep(s)

    def ag(S):
        S.put("ag", S.lanes.launch("ag", 0.05))

    def f2(S):
        S.get("ag")
        time.sleep(0.02)
    ops = [Op(OpSpec("f1", COMPUTE, "compute"), sleep(0.02)),
           Op(OpSpec("ag", COMM, "intra"), ag), Op(OpSpec("f2", COMPUTE, "compute"), f2)]
    tracer = Tracer()
    execute_step((StrandState(SlowCpuLanes(), "α"), ops), None, tracer)
    assert isinstance(tracer.clock, HostClock)
    ev = {e.op: e for e in tracer.events}
    assert 0.02 <= ev["f1"].end - ev["f1"].start < 0.045
    assert 0.02 <= ev["f2"].end - ev["f2"].start < 0.045    # without its 50 ms wait
    assert ev["ag"].end - ev["ag"].start >= 0.05
    assert ev["f1"].end <= ev["ag"].start <= ev["f2"].start


# -- the profiler's layer is the training layer ----------------------------------------------
def _layer_classes(module):
    return {name: type(m).__name__ for name, m in module.named_modules()}


def harness_and_train_layers(claim_cuda: bool):
    """Submodule classes of the profiler's layer and of `dhelix train --dhelix`'s first
    layer, for the tiny model. `claim_cuda`: torch says CUDA is available while the
    profiler's layer is built (on CPU), as on the GPU machines where the two differed."""
    from dhelix.models.config import load_model_config
    from dhelix.profiler.harness import LayerHarness
    from dhelix.train.schedules import make_schedule
    from dhelix.train.build import build
    from dhelix.train.config import TrainConfig, check_layout
    from dhelix.train.trainer import setup_megatron
    cfg = TrainConfig(config="tiny", seq_length=32, micro_batch_size=2, train_iters=1)
    m = load_model_config("tiny")
    layout = check_layout(cfg, m, 1)
    tconfig = setup_megatron(cfg, m, layout)
    built = build(cfg, m, tconfig, layout, torch.device("cpu"),
                  make_schedule({"enabled": True}).layer_module)
    train_layer = built.chunks[0].module.decoder.layers[0]
    if claim_cuda:
        # spec choices read torch.cuda.is_available(); seeding CUDA's RNG cannot run here
        import megatron.core.tensor_parallel as mtp
        torch.cuda.is_available = lambda: True
        mtp.model_parallel_cuda_manual_seed = lambda *a, **k: None
    h = LayerHarness(m, tp=1, sp=False, seq=32, mbs=2)
    return _layer_classes(h.layer), _layer_classes(train_layer)


@pytest.mark.parametrize("claim_cuda", [False, True])
def test_profiler_builds_the_training_layer(claim_cuda):
    prof, train = run_ranks(harness_and_train_layers, 1, claim_cuda, timeout=300)[0]
    assert prof == train
    assert prof[""] == "DHelixLayer" and prof["input_layernorm"] == "Norm"
    assert prof["self_attention.core_attention"] == "SDPAttention"


# -- activation memory per step ---------------------------------------------------------------
def test_step_memory_cpu_counts_what_the_step_adds():
    mem = StepMemory(torch.device("cpu"))
    weights = torch.zeros(1000)
    keep = METER.hold(weights)              # lives across steps: not the step's
    mem.begin()
    act = torch.zeros(250)
    tok = METER.hold(act)
    assert mem.activation_peak() == act.untyped_storage().nbytes()
    del tok, act
    mem.begin()                             # the next step: the peak starts again
    assert mem.activation_peak() == 0
    assert mem.total_peak() > 0 and "saved-tensor" in mem.method
    del keep


def test_step_memory_cuda_subtracts_the_start(monkeypatch):
    # a fake allocator (no CUDA here): 1000 B of weights, a 5000 B peak from before
    alloc = {"now": 1000, "peak": 5000}

    def reset(device=None):
        alloc["peak"] = alloc["now"]

    def allocate(n):
        alloc["now"] += n
        alloc["peak"] = max(alloc["peak"], alloc["now"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: alloc["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: alloc["peak"])
    mem = StepMemory(torch.device("cuda", 0))
    mem.begin()
    allocate(300)
    allocate(-300)
    allocate(100)
    assert mem.activation_peak() == 300 and mem.total_peak() == 1300
    allocate(-100)
    mem.begin()
    allocate(50)
    assert mem.activation_peak() == 50 and mem.total_peak() == 1050


def test_train_reports_activation_peak_per_iteration():
    """megatron's schedule and DHelix's report the same keys, measured the same way."""
    keys = None
    for dhelix in ({}, {"enabled": True}):
        r = run_ranks(train_result, 2, timeout=400, config="tiny",
                      tensor_model_parallel_size=2, sequence_parallel=True, train_iters=3,
                      seq_length=32, micro_batch_size=2, dhelix=dhelix)[0]
        per_iter = r["peak_memory_bytes_per_iter"]
        assert len(per_iter) == 3 and all(v > 0 for v in per_iter)
        assert r["peak_memory_bytes"] == max(per_iter)
        # the same shapes every step: each step's own peak, equal from step to step
        assert per_iter[1] == per_iter[2]
        assert r["peak_memory_total_bytes"] > r["peak_memory_bytes"]
        assert r["memory_method"] == "saved-tensor accounting"
        mine = {k for k in r if k.startswith("peak_") or k.startswith("memory_")}
        assert keys is None or mine == keys
        keys = mine
