"""Per-rank bodies of the link tests."""
import time

import torch
import torch.distributed as dist


def time_collectives():
    """Each collective on a 2-rank group: wall time, this process's CPU time, and the
    link model's own prediction; plus an async all-gather overlapped with a GEMM."""
    from dhelix.links.paced import active
    from dhelix.planner.costmodel import collective_seconds
    link = active()
    g = dist.new_group([0, 1])
    x = torch.ones(1 << 19)              # 2 MiB
    out = torch.empty(1 << 20)
    res = {}
    cases = [("all_gather", out, lambda: dist.all_gather_into_tensor(out, x, group=g)),
             ("all_reduce", x, lambda: dist.all_reduce(x, group=g)),
             ("reduce_scatter", x,
              lambda: dist.reduce_scatter_tensor(torch.empty(1 << 18), x, group=g))]
    for name, buf, fn in cases:
        # once untimed: the first call on a group maps and faults in its shared-memory
        # buffers (tens of ms of CPU on a loaded machine), which is set-up, not the link
        fn()
        dist.barrier()
        t, c = time.perf_counter(), time.process_time()
        fn()
        res[name] = {"wall": time.perf_counter() - t, "cpu": time.process_time() - c,
                     "model": collective_seconds(name, buf.numel() * 4, 2, link.rate,
                                                 link.latency)}
    # two collectives issued back to back queue on the group's FIFO link
    dist.barrier()
    t = time.perf_counter()
    w1 = dist.all_reduce(x, group=g, async_op=True)
    w2 = dist.all_reduce(x, group=g, async_op=True)
    w1.wait()
    t1 = time.perf_counter() - t
    w2.wait()
    res["fifo"] = {"first": t1, "both": time.perf_counter() - t,
                   "model": res["all_reduce"]["model"]}
    # a ring step (send to one neighbour, receive from the other) on a full-duplex link:
    # one transfer's time, the cost model's "send_recv"; two sends queue
    dist.barrier()
    peer = 1 - dist.get_rank()
    t = time.perf_counter()
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, peer, g),
                                    dist.P2POp(dist.irecv, torch.empty_like(x), peer, g)])
    for w in works:
        w.wait()
    res["ring_step"] = {"wall": time.perf_counter() - t,
                        "model": collective_seconds("send_recv", x.numel() * 4, 2,
                                                    link.rate, link.latency)}
    # the default group is control traffic: not paced
    dist.barrier()
    t = time.perf_counter()
    dist.all_reduce(x)
    res["default_group_s"] = time.perf_counter() - t
    return res


def _idle(link):
    """Sleep until every transfer recorded so far has ended (none in flight)."""
    left = link.in_flight_until() - time.perf_counter()
    if left > 0:
        time.sleep(left + 1e-3)


def stretch_gemms(n_mm=200, size=256):
    """Under a paced link (with or without slow=): a chain of `n_mm` GEMMs run with no
    transfer in flight, then the same chain while an async all-gather on a 2-rank group is
    in flight (issued before, waited after), then a backward pass (forward with nothing in
    flight, backward while an all-gather is) — each with the link's own accounting of the
    window: stretch charged, GEMMs stretched, in-flight seconds. Also the results, to see
    the stretch changes no value."""
    from dhelix.links.contention import installed
    from dhelix.links.paced import active
    link = active()
    g = dist.new_group([0, 1])
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=gen)
    b = torch.linalg.qr(torch.randn(size, size, generator=gen))[0]   # keeps norms

    def chain():
        y = a
        for _ in range(n_mm):
            y = torch.mm(y, b)
        return y

    def window(fn):
        s, ops = link.stretched_s, link.stretched_ops
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        return out, {"stretched": link.stretched_s - s, "ops": link.stretched_ops - ops,
                     "busy": link.busy_seconds(t0, t1), "wall": t1 - t0}

    res = {"hook": installed(), "link_hook": link.stretch_hook, "slow": link.slow}
    chain()                                              # warm up
    _idle(link)
    count = link.count
    y_idle, res["idle"] = window(chain)
    res["idle"]["collectives"] = link.count - count
    # ~0.84 s of modelled all-gather at 10 Mbit/s; the chain takes ~0.05-0.5 s
    dist.barrier()
    x = torch.full((1 << 18,), float(rank))
    out = torch.empty(1 << 19)
    work = dist.all_gather_into_tensor(out, x, group=g, async_op=True)
    y_busy, res["busy"] = window(chain)
    work.wait()
    res["gathered"] = bool(torch.equal(out[:1 << 18], torch.zeros(1 << 18)) and
                           torch.equal(out[1 << 18:], torch.ones(1 << 18)))
    res["same_values"] = bool(torch.equal(y_idle, y_busy))
    res["y"] = y_busy
    # autograd's backward: its GEMMs are stretched too (the hook is on its thread)
    _idle(link)
    w = b.clone().requires_grad_(True)
    (h, res["forward"]) = window(lambda: torch.mm(torch.mm(a, w).tanh(), w).sum())
    dist.barrier()
    work = dist.all_gather_into_tensor(torch.empty(1 << 19), torch.ones(1 << 18), group=g,
                                       async_op=True)               # 0.84 s modelled
    _, res["backward"] = window(h.backward)
    work.wait()
    res["grad"] = w.grad
    res["total"] = {"stretched": link.stretched_s, "ops": link.stretched_ops,
                    "slept": link.stretch_slept_s}
    return res


def train_with_stretch(**kw):
    """`train_fns.train_result`, plus the paced link's contention accounting."""
    from dhelix.links.paced import active
    from train_fns import train_result
    res = train_result(**kw)
    link = active()
    res["stretch"] = None if link is None else {
        "hook": link.stretch_hook, "stretched_s": link.stretched_s,
        "ops": link.stretched_ops, "slept_s": link.stretch_slept_s}
    return res


def shm_sums():
    """Sums over shared memory on a 3-rank group: each rank's inputs are known to every
    rank, so each returns how far its results are from the left-to-right sums (rank 0 +
    rank 1 + rank 2) and from the gathered rows, bit for bit; the all-reduce also on a
    non-contiguous buffer (a transposed view)."""
    from dhelix.links.paced import active
    g = dist.new_group([0, 1, 2])
    me = dist.get_rank()

    def data(r, shape):        # rank r's input: values whose sums round differently
        gen = torch.Generator().manual_seed(100 + r)
        return torch.randn(shape, generator=gen) * 10 ** (r - 1)

    def want_sum(shape):
        acc = data(0, shape).clone()
        for r in (1, 2):
            acc += data(r, shape)
        return acc

    res = {}
    x = data(me, (96, 64))
    dist.all_reduce(x, group=g)
    res["all_reduce"] = (x != want_sum((96, 64))).sum().item()
    # a transposed (non-contiguous) buffer: summed in its own element order
    base = data(me, (64, 96))
    xt = base.t()
    dist.all_reduce(xt, group=g)
    res["all_reduce_noncontig"] = (xt != want_sum((64, 96)).t()).sum().item()
    x = data(me, (96, 64))
    out = torch.empty(32, 64)
    dist.reduce_scatter_tensor(out, x, group=g)
    res["reduce_scatter"] = (out != want_sum((96, 64))[32 * me:32 * (me + 1)]).sum().item()
    out = torch.empty(3 * 32, 64)
    dist.all_gather_into_tensor(out, data(me, (32, 64)), group=g)
    res["all_gather"] = (out != torch.cat([data(r, (32, 64)) for r in range(3)])).sum().item()
    res["shm_groups"] = sum(v is not None for v in active().shm_groups.values())
    return res


def shm_waits_out_of_order():
    """Four all-gathers in flight on a 2-rank group (the slot ring's depth); each rank
    waits for the fourth first, as DHelix's readers may. Rank 1 then issues a fifth at
    once while rank 0 is slow to read the first: rank 1 must not reuse the first one's
    slot before rank 0 has read it. Returns how many elements of each result differ from
    the gathered inputs."""
    import time
    g = dist.new_group([0, 1])
    me = dist.get_rank()

    def data(r, i):
        return torch.full((64, 64), float(100 * i + r))

    outs, works = [], []
    for i in range(4):
        outs.append(torch.empty(128, 64))
        works.append(dist.all_gather_into_tensor(outs[i], data(me, i), group=g,
                                                 async_op=True))
    works[3].wait()
    if me == 0:
        time.sleep(1.0)          # rank 1 issues the fifth meanwhile
    for w in works[:3]:
        w.wait()
    out4 = torch.empty(128, 64)
    dist.all_gather_into_tensor(out4, data(me, 4), group=g)
    outs.append(out4)
    return [int((o != torch.cat([data(0, i), data(1, i)])).sum()) for i, o in enumerate(outs)]


def late_peer():
    """The paced link's account of waits the model does not price, on paced:1000gbit
    (transfers of ~µs): rank 1 sleeps 0.3 s before its part of an all-gather, so rank 0
    waits for late data; then rank 0 issues five all-gathers back to back (one more
    than the slot ring holds) while rank 1 sleeps 0.3 s before its own, so rank 0's
    fifth waits for a free slot. Returns this rank's (late, slot) seconds for each part."""
    from dhelix.links.paced import active
    from dhelix.links.shm import PEER_WAIT
    link = active()
    g = dist.new_group([0, 1])
    me = dist.get_rank()
    x, out = torch.ones(1024), torch.empty(2048)
    dist.all_gather_into_tensor(out, x, group=g)        # the segments attached
    dist.barrier()
    l0, s0 = link.late_s, PEER_WAIT["slot_s"]
    if me == 1:
        time.sleep(0.3)
    dist.all_gather_into_tensor(out, x, group=g)
    l1, s1 = link.late_s, PEER_WAIT["slot_s"]
    dist.barrier()
    if me == 1:
        time.sleep(0.3)
    outs = [torch.empty(2048) for _ in range(5)]
    works = [dist.all_gather_into_tensor(o, x, group=g, async_op=True) for o in outs]
    for w in works:
        w.wait()
    return {"late": (l1 - l0, link.late_s - l1), "slot": (s1 - s0, PEER_WAIT["slot_s"] - s1)}


def reads_posted_collectives(eager):
    """Rank 1 keeps a posted all-gather unread (its reader is 0.5 s away) while it issues
    three more; rank 0 then issues a fifth, which needs the first one's slot. With
    `shm.EAGER` rank 1 read the first at its next issue, so rank 0's issue need not wait;
    without, rank 0 waits until rank 1 reads it. Returns this rank's seconds waited at
    issue and how many elements of each result differ from the gathered inputs."""
    from dhelix.links import shm
    shm.EAGER = eager
    g = dist.new_group([0, 1])
    me = dist.get_rank()

    def data(r, i):
        return torch.full((64, 64), float(100 * i + r))
    outs = [torch.empty(128, 64) for _ in range(5)]
    dist.all_gather_into_tensor(outs[0], data(me, 0), group=g)     # segments attached
    outs[0] = torch.empty(128, 64)
    works = [dist.all_gather_into_tensor(outs[0], data(me, 0), group=g, async_op=True)]
    dist.barrier()                                 # every rank has posted the first
    works += [dist.all_gather_into_tensor(outs[i], data(me, i), group=g, async_op=True)
              for i in (1, 2, 3)]
    dist.barrier()
    s0 = shm.PEER_WAIT["slot_s"]
    if me == 1:
        time.sleep(0.5)
        for w in works:
            w.wait()
    works.append(dist.all_gather_into_tensor(outs[4], data(me, 4), group=g, async_op=True))
    waited = shm.PEER_WAIT["slot_s"] - s0
    for w in works:
        w.wait()
    shm.EAGER = True
    return {"slot_s": waited,
            "wrong": [int((o != torch.cat([data(0, i), data(1, i)])).sum())
                      for i, o in enumerate(outs)]}


def direct_lanes():
    """DHelix's gloo lanes on the paced link: an all-gather and a reduce-scatter straight
    to the link (`paced.direct`) and through torch.distributed (DIRECT off), each counted
    once by the link model and modelled alike; their results, per rank."""
    from dhelix.links import paced
    from dhelix.strand.lanes import CpuLanes
    link = paced.active()
    g = dist.new_group([0, 1])
    lanes = CpuLanes()
    r = dist.get_rank()
    x = torch.arange(6 * 4, dtype=torch.float32).view(6, 4) * (r + 1) + 0.5
    out = {"direct_for_default": paced.direct(dist.group.WORLD, "all_gather") is not None,
           "direct_for_group": paced.direct(g, "all_gather") is not None}
    for mode in (True, False):
        paced.DIRECT = mode
        n0, m0 = link.count, link.modelled_s
        ag = lanes.resolve(lanes.all_gather("ag", x, g, "intra"))
        rs = lanes.resolve(lanes.reduce_scatter("rs", x, g, "intra"))
        out[mode] = {"ag": ag.clone(), "rs": rs.clone(), "count": link.count - n0,
                     "modelled": link.modelled_s - m0}
    paced.DIRECT = True
    return out


def profiled_host_times():
    """`LayerHarness.time_comm_host` on a slow paced link: the comm ops' host times, and
    for every wait it times (those after its second barrier of a repeat; the states it
    builds in between run comms of their own) how long before its modelled end it came."""
    from dhelix.links.paced import PacedWork
    from dhelix.models.config import load_model_config
    from dhelix.profiler.harness import LayerHarness
    h = LayerHarness(load_model_config("tiny"), tp=2, sp=True, seq=32, mbs=2)
    # a repeat: build the state (its own comms), barrier, issue the op, barrier, wait
    timed = {"syncs": 0, "early_s": []}
    sync = h._sync

    def synced():
        sync()
        timed["syncs"] += 1
    h._sync = synced
    for name in ("fwd_state", "bwd_state"):
        def fresh(k, build=getattr(h, name)):
            timed["syncs"] = -1000          # not a timed wait: the state's own comms
            S = build(k)
            timed["syncs"] = 0
            return S
        setattr(h, name, fresh)
    wait = PacedWork.wait

    def timed_wait(self, timeout=None):
        if timed["syncs"] >= 2:
            timed["early_s"].append(self.done_at - time.perf_counter())
        return wait(self, timeout)
    PacedWork.wait = timed_wait
    try:
        host_f, host_b = h.time_comm_host(0, 3)
    finally:
        PacedWork.wait = wait
    return {"host_f": host_f, "host_b": host_b, "early_s": timed["early_s"]}
