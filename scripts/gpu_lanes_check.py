#!/usr/bin/env python3
"""The CUDA lanes check on the lent GPU (a step of scripts/gpu_check.sh).

    python3 scripts/gpu_lanes_check.py          # CudaLanes on one GPU (JSON out)

**lanes**: one GPU can hold only a one-rank NCCL group, but its collectives still run
kernels on the lane stream, which is what stream ordering and buffer lifetimes are about.
For each collective of `dhelix.strand.lanes.CudaLanes`: the input is made on the compute
stream; `torch.cuda._sleep` (about 50 ms) is queued on the lane stream BEFORE the launch,
so the collective reads its input late; the input's last Python reference is dropped and
a tensor of the same size is allocated and filled with -1 on the compute stream (the
caching allocator hands it the freed block unless the lane recorded or kept the input);
then `resolve`, and the output must equal the input (on one rank all-gather,
reduce-scatter, all-reduce and all-to-all are the identity). The lane's own reference to
its inputs (`Pending.keep`) is dropped right after the launch, so only the lane's
`record_stream` keeps the block from the compute stream: what the check tests. A control
runs the unsafe pattern (NCCL on a side stream, input not recorded): when it comes out
corrupted, the check is known to see this bug on this machine. P2P (send/recv,
ring_exchange, p2p) needs two ranks: skipped.

**overlap**: a lane's work (a `_sleep` of about 50 ms, then an all-reduce, launched through
CudaLanes as DHelix launches a collective) beside a loop of GEMMs of about 50 ms on the
compute stream: each alone, then both (lane first, as a step issues its comm before the
other strand's compute), timed on the compute stream with CUDA events. The overlap
effectiveness OEF = (T_gemm + T_lane − T_both) / min(T_gemm, T_lane) must be at least
OVERLAP_MIN: the pair takes about the longer of the two, not their sum. It runs at the
process's CUDA_DEVICE_MAX_CONNECTIONS (gpu_check.sh: 1, as every `dhelix train` sets),
where a lane stream waiting on a dependency can hold the single hardware queue.
Exit 0 pass, 1 fail, 77 no CUDA."""
from __future__ import annotations

import json
import math
import os
import socket
import sys
from typing import Dict, Tuple

SKIP_RC = 77         # gpu_check_run.py reads it as a skip


SLEEP_S = 0.05
SHAPE = (1024, 1024)          # 4 MiB of fp32: a large-pool block, handed over whole
OVERLAP_MIN = 0.5             # OEF the lane and the compute stream must reach together


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _version(v) -> str:
    return ".".join(map(str, v)) if isinstance(v, (tuple, list)) else str(v)


def lanes_check() -> Tuple[int, Dict]:
    import torch
    if not torch.cuda.is_available():
        return SKIP_RC, {"status": "skip", "reason": "no CUDA device"}
    import torch.distributed as dist
    from dhelix.strand.lanes import CudaLanes

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, device_id=dev)
    group = dist.group.WORLD
    lanes = CudaLanes()

    # cycles for SLEEP_S, measured (the clock idles low until the GPU is busy)
    probe = 10_000_000
    torch.cuda._sleep(probe)                        # warm-up
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    torch.cuda._sleep(probe)
    e1.record()
    torch.cuda.synchronize()
    cycles = max(probe, int(probe * SLEEP_S * 1000 / max(e0.elapsed_time(e1), 1e-3)))

    def values(k: int, rows: int = SHAPE[0]) -> "torch.Tensor":
        n = rows * SHAPE[1]                          # exact in fp32: < 2**24
        return torch.arange(n, dtype=torch.float32, device=dev).add_(k * 2**20).view(
            rows, SHAPE[1])

    def race(*a) -> Dict:
        try:
            return _race(*a)
        except Exception as e:          # an error is a failed case, the others still run
            torch.cuda.synchronize()
            return {"status": "fail", "error": f"{type(e).__name__}: {e}"[:500]}

    def _race(k: int, lane_streams, launch, resolve, wanted_rows=SHAPE[0]) -> Dict:
        """Input made on the compute stream; the lane delayed; the collective launched;
        the input's last reference dropped and a same-size tensor filled with -1 on the
        compute stream; then resolve, and the output read on the compute stream."""
        torch.cuda.synchronize()
        torch.cuda.empty_cache()    # no other free block of this size: the handover is sure
        x = values(k)
        for s in lane_streams:
            with torch.cuda.stream(s):
                torch.cuda._sleep(cycles)
        handle = launch(x)
        for p in handle if isinstance(handle, list) else [handle]:
            if hasattr(p, "keep"):
                p.keep = ()         # only the lane's record_stream protects the input now
        ptr = x.data_ptr()
        del x
        y = torch.empty(SHAPE, dtype=torch.float32, device=dev)
        y.fill_(-1.0)
        reused = y.data_ptr() == ptr
        lane_busy = not all(s.query() for s in lane_streams)
        outs = [o.clone() for o in resolve(handle)]
        torch.cuda.synchronize()
        want = values(k, wanted_rows)
        errs = [float((o - want).abs().max()) if o.shape == want.shape else math.inf
                for o in outs]
        del y
        return {"status": "pass" if max(errs) == 0 else "fail", "max_abs_err": max(errs),
                "input_block_reused": reused, "lane_busy_at_overwrite": lane_busy}

    one = lambda p: [lanes.resolve(p)]
    cases: Dict[str, Dict] = {}
    cases["all_gather"] = race(1, [lanes._stream("intra")],
                               lambda x: lanes.all_gather("ag", x, group, "intra"), one)
    cases["reduce_scatter"] = race(2, [lanes._stream("intra")],
                                   lambda x: lanes.reduce_scatter("rs", x, group, "intra"), one)
    cases["all_reduce"] = race(3, [lanes._stream("inter")],
                               lambda x: lanes.all_reduce("ar", x, group, "inter"), one)
    cases["all_to_all"] = race(4, [lanes._stream("inter")], lambda x: lanes.all_to_all(
        "a2a", x, [SHAPE[0]], [SHAPE[0]], group, "inter"), one)

    def two(x):     # two lanes at once, waited by one barrier
        y = values(5)
        ps = [lanes.all_gather("ag-intra", x, group, "intra"),
              lanes.all_gather("ag-inter", y, group, "inter")]
        del y
        return ps

    def barrier(ps):
        lanes.barrier(ps)
        return [p.out for p in ps]
    cases["barrier"] = race(5, [lanes._stream("intra"), lanes._stream("inter")], two, barrier)
    for name in ("send", "recv", "p2p", "ring_exchange"):
        cases[name] = {"status": "skip", "reason": "point-to-point needs two ranks"}

    # the control: the unsafe pattern itself (NCCL on a side stream, the input not recorded)
    side = torch.cuda.Stream()

    def unsafe(x):
        out = torch.empty_like(x)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dist.all_gather_into_tensor(out, x, group=group)
            ev = torch.cuda.Event()
            ev.record(side)
        out.record_stream(side)
        return out, ev

    def unsafe_resolve(h):
        torch.cuda.current_stream().wait_event(h[1])
        return [h[0]]
    control = race(6, [side], unsafe, unsafe_resolve)
    control["corrupted"] = control.pop("status") == "fail" and "error" not in control

    try:
        overlap = _overlap(torch, lanes, group, dev, cycles)
    except Exception as e:
        torch.cuda.synchronize()
        overlap = {"status": "fail", "error": f"{type(e).__name__}: {e}"[:500]}
    cases["overlap"] = overlap

    dist.destroy_process_group()
    checked = [c for c in cases.values() if c["status"] != "skip"]
    ok = all(c["status"] == "pass" for c in checked)
    res = {"status": "pass" if ok else "fail", "device": torch.cuda.get_device_name(),
           "torch": torch.__version__, "nccl": _version(torch.cuda.nccl.version()),
           "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
           "sleep_cycles": cycles, "sleep_ms": SLEEP_S * 1000,
           "passed": sum(c["status"] == "pass" for c in checked), "checked": len(checked),
           "cases": cases, "control": control,
           "control_sees_the_bug": control["corrupted"]}
    return (0 if ok else 1), res


def _overlap(torch, lanes, group, dev, cycles) -> Dict:
    """T_gemm, T_lane and T_both (ms, CUDA events on the compute stream) and their OEF."""
    a = torch.randn(2048, 2048, device=dev)
    out = torch.empty_like(a)
    buf = torch.ones(1 << 20, device=dev)
    compute = torch.cuda.current_stream()

    def timed(fn) -> float:
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(compute)
        fn()
        e1.record(compute)
        torch.cuda.synchronize()
        return e0.elapsed_time(e1)

    def gemms(n):
        for _ in range(n):
            torch.mm(a, a, out=out)

    gemms(3)                                           # warm-up (cuBLAS handles, clocks)
    n = max(1, int(round(SLEEP_S * 1000 / max(timed(lambda: gemms(10)) / 10, 1e-3))))

    def lane():
        s = lanes._stream("inter")
        with torch.cuda.stream(s):
            torch.cuda._sleep(cycles)
        return lanes.all_reduce("overlap", buf, group, "inter")

    lane_alone = timed(lambda: lanes.resolve(lane()))
    gemm_alone = timed(lambda: gemms(n))

    def both():
        p = lane()
        gemms(n)
        lanes.resolve(p)
    together = timed(both)
    oef = (gemm_alone + lane_alone - together) / max(min(gemm_alone, lane_alone), 1e-6)
    return {"status": "pass" if oef >= OVERLAP_MIN else "fail", "oef": round(oef, 3),
            "gemm_ms": round(gemm_alone, 2), "lane_ms": round(lane_alone, 2),
            "both_ms": round(together, 2), "gemms": n, "min_oef": OVERLAP_MIN,
            "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS")}


def lanes_main() -> int:
    rc, res = lanes_check()
    for name, c in res.get("cases", {}).items():
        print(f"{name:15s} {c['status']:5s} " + " ".join(
            f"{k}={v}" for k, v in c.items() if k != "status"))
    if "control" in res:
        c = res["control"]
        print(f"control (unsafe pattern): corrupted={c['corrupted']} "
              f"(block reused={c.get('input_block_reused')}): " +
              ("the check sees this bug here" if c["corrupted"] else
               "NOT seen here: a pass above is weaker evidence"))
    print("RESULT " + json.dumps(res))
    if "cases" in res:
        print(f"lanes: {res['passed']}/{res['checked']} collectives pass; the control "
              f"{'sees' if res['control_sees_the_bug'] else 'does NOT see'} the bug here")
    else:
        print(f"skip: {res.get('reason')}")
    return rc


if __name__ == "__main__":
    sys.exit(lanes_main())
