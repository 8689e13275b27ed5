"""Emulated links: `--link` parsing, the paced link model, training over it."""
import pytest

from dhelix.links import LinkError, parse_link, parse_rate
from dhelix.testing import run_ranks
from compare import same_numbers
import link_fns
from train_fns import train_result

PACED = "paced:100mbit,20us"
SLACK, SLACK_S = 1.25, 0.02      # a collective may end up to 25% + 20 ms late (loaded CI)


def test_parse_link():
    assert parse_link("none").kind == "none"
    p = parse_link("paced:2gbit,50us")
    assert (p.kind, p.rate_Bps) == ("paced", 2.5e8) and p.latency_s == pytest.approx(50e-6)
    assert parse_link("paced:1gbit").latency_s == pytest.approx(20e-6)
    t = parse_link("800mbit")
    assert t.kind == "tbf" and t.rate_Bps == 1e8
    assert parse_rate("8gbit") == 1e9 and parse_rate("100mbps") == 1e8
    for bad, msg in (("fast", "cannot read rate 'fast'"), ("paced:", "use paced:RATE"),
                     ("paced:1gbit,soon", "cannot read latency 'soon'"),
                     ("paced:1gbit,1us,2us", "use paced:RATE")):
        with pytest.raises(LinkError, match=msg):
            parse_link(bad)


def test_paced_link_delays_to_the_model_holding_no_cpu():
    """On each of 2 ranks, an all-gather, an all-reduce and a reduce-scatter of 2-4 MiB over
    paced:100mbit,20us each take from 0.99x to 1.25x + 20 ms (slack for a loaded CI machine)
    of the modelled time (ring bytes / 100 Mbit/s + latency, 84-168 ms), while the process
    uses under a quarter of that wall time as CPU time; two all-reduces issued together
    queue on the FIFO link (the first ends after >= 0.99x one modelled time, both after
    >= 0.99x two); a ring step (send one way, receive the other) takes one transfer's
    modelled time, within the same bounds; an all-reduce on the default group is not
    paced (under half the all-gather's modelled time)."""
    for res in run_ranks(link_fns.time_collectives, 2, env={"DHELIX_LINK": PACED},
                         timeout=120):
        for name in ("all_gather", "all_reduce", "reduce_scatter"):
            r = res[name]
            assert r["model"] > 0.05                          # 84-168 ms at 100 Mbit/s
            assert r["model"] * 0.99 <= r["wall"] <= r["model"] * SLACK + SLACK_S, (name, r)
            assert r["cpu"] < 0.25 * r["wall"], (name, r)     # waiting, not computing
        f = res["fifo"]
        assert f["first"] >= f["model"] * 0.99
        assert f["both"] >= 2 * f["model"] * 0.99              # the second queued
        r = res["ring_step"]                                   # full duplex: one transfer
        assert r["model"] * 0.99 <= r["wall"] <= r["model"] * SLACK + SLACK_S, r
        assert res["default_group_s"] < 0.5 * res["all_gather"]["model"]


def test_training_over_the_paced_link_is_unchanged():
    """4 steps of TP=2+SP on 2 ranks, megatron and DHelix over paced:10mbit: on every rank
    the link was on (it paced > 0 collectives, modelled > 0 s of transfer) and slowed the
    run (its waits slept past the data's arrival: > 0 s; 1.1-1.9 s of the 2.07 s modelled
    when written), the run with DHELIX_LINK=none had no link, and the losses are
    bit-identical to that run's (pacing delays, never changes, a collective)."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=4, global_batch_size=6, seq_length=32)
    # slow enough that the waits sleep: ~2 s of modelled transfer per rank for this run
    env = {"DHELIX_LINK": "paced:10mbit"}
    plain = run_ranks(train_result, 2, timeout=300, env={"DHELIX_LINK": "none"}, **kw)
    base = run_ranks(train_result, 2, timeout=300, env=env, **kw)
    dh = run_ranks(train_result, 2, timeout=300, env=env, dhelix={"enabled": True}, **kw)
    assert len(plain) == len(base) == len(dh) == 2
    for rank, (p, b, d) in enumerate(zip(plain, base, dh)):
        assert p["link"] is None, (rank, p["link"])
        for name, r in (("megatron", b), ("dhelix", d)):
            link = r["link"]
            assert link is not None, f"rank {rank} {name}: DHELIX_LINK was not installed"
            assert link["collectives"] > 0, (rank, name, link)
            assert link["modelled_s"] > 0, (rank, name, link)
            assert link["waited_s"] > 0, (rank, name, link)     # the link slowed the run
        same_numbers(b["losses"], p["losses"], tol=0.0, what=f"rank {rank} megatron losses")
        same_numbers(d["losses"], p["losses"], tol=0.0, what=f"rank {rank} dhelix losses")


def test_shm_attach_waits_for_a_segment_being_sized():
    """A peer's segment can exist with size 0 for a moment (between the owner's shm_open
    and its ftruncate): attaching waits instead of failing with "cannot mmap an empty
    file" (seen once in a full suite run)."""
    import os
    import threading
    import time
    from dhelix.links import shm
    tag = f"t{os.getpid()}"
    g = shm.ShmGroup(tag, [0, 1], 0)
    path = f"/dev/shm/dhx-{tag}-1"
    open(path, "wb").close()                        # the peer's file, not yet sized
    peer = {}

    def owner():                                    # the owner finishes creating it
        time.sleep(0.2)
        peer["seg"] = shm._Segment(f"dhx-{tag}-1", create=True)   # replaces the empty file
    t = threading.Thread(target=owner)
    t.start()
    try:
        seg = g.seg(1)
        assert int(seg.ctr[2]) == shm.READY
    finally:
        t.join()
        os.remove(path)                              # (unregistered when attached)
        g._unlink()
