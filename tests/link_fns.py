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
