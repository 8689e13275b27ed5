"""Emulated links: `--link` parsing, the paced link model, training over it."""
import pytest

from dhelix.links import LinkError, parse_link, parse_rate
from dhelix.testing import run_ranks
import link_fns
from train_fns import train_result

PACED = "paced:100mbit,20us"


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
    """Each collective ends at the modelled time (ring bytes / 100 Mbit/s + latency),
    no sooner, and no later than 25% plus 20 ms (slack for a loaded CI machine), while the process uses a small fraction of that as CPU time;
    two collectives issued together queue on the FIFO link; the default group is not
    paced."""
    for res in run_ranks(link_fns.time_collectives, 2, env={"DHELIX_LINK": PACED},
                         timeout=120):
        for name in ("all_gather", "all_reduce", "reduce_scatter"):
            r = res[name]
            assert r["model"] > 0.05                          # 84-168 ms at 100 Mbit/s
            assert r["model"] * 0.99 <= r["wall"] <= r["model"] * 1.25 + 0.02, (name, r)
            assert r["cpu"] < 0.25 * r["wall"], (name, r)     # waiting, not computing
        f = res["fifo"]
        assert f["first"] >= f["model"] * 0.99
        assert f["both"] >= 2 * f["model"] * 0.99              # the second queued
        r = res["ring_step"]                                   # full duplex: one transfer
        assert r["model"] * 0.99 <= r["wall"] <= r["model"] * 1.25 + 0.02, r
        assert res["default_group_s"] < 0.5 * res["all_gather"]["model"]


def test_training_over_the_paced_link_is_unchanged():
    """megatron and DHelix over the paced link: the same losses as each other and as
    without the link (pacing delays, never changes, a collective)."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=4, global_batch_size=6, seq_length=32)
    env = {"DHELIX_LINK": "paced:2gbit"}
    plain = run_ranks(train_result, 2, timeout=300, **kw)[0]
    base = run_ranks(train_result, 2, timeout=300, env=env, **kw)[0]
    dh = run_ranks(train_result, 2, timeout=300, env=env, dhelix={"enabled": True}, **kw)[0]
    assert base["losses"] == plain["losses"] == dh["losses"]


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
