"""Emulated links: `--link` parsing, the paced link model, training over it."""
import json
import pytest
import torch

from dhelix.links import LinkError, parse_link, parse_rate
from dhelix.links.paced import PacedLink, union_seconds
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


def test_parse_paced_slow():
    """`slow=X` after the rate (and the optional latency) sets the contention share; the
    text stays as given (ranks re-read it from DHELIX_LINK); bad values name the flag and
    the fix."""
    p = parse_link("paced:1gbit,20us,slow=0.15")
    assert (p.kind, p.rate_Bps, p.slow) == ("paced", 1.25e8, 0.15)
    assert p.latency_s == pytest.approx(20e-6) and p.text == "paced:1gbit,20us,slow=0.15"
    p = parse_link("paced:1gbit,slow=0.15")
    assert (p.rate_Bps, p.slow) == (1.25e8, 0.15) and p.latency_s == pytest.approx(20e-6)
    assert parse_link("paced:2gbit,50us,slow=4").slow == 4.0
    assert parse_link("paced:2gbit,slow=0").slow == 0.0
    assert parse_link("paced:2gbit,50us").slow == 0.0 and parse_link("1gbit").slow == 0.0
    for bad, msg in (("paced:1gbit,slow=abc", r"--links: cannot read slow='abc': give a "
                      r"number from 0 to 4"),
                     ("paced:1gbit,20us,slow=-1", r"--links: slow='-1' is out of range: "
                      r"give a number from 0 to 4"),
                     ("paced:1gbit,slow=4.5", "out of range"),
                     ("paced:1gbit,slow=nan", "out of range"),
                     ("paced:1gbit,slow=", "cannot read slow=''"),
                     ("paced:1gbit,fast=1", r"unknown option 'fast': the paced link takes "
                      r"slow=X only \(paced:RATE\[,LATENCY\]\[,slow=X\]"),
                     ("paced:1gbit,slow=0.1,slow=0.2", "slow= given twice"),
                     ("paced:1gbit,slow=0.1,20us", "the latency comes right after the rate"),
                     ("paced:slow=0.1", r"use paced:RATE\[,LATENCY\]\[,slow=X\]"),
                     ("1gbit,slow=0.1", "for the paced link only")):
        with pytest.raises(LinkError, match=msg):
            parse_link(bad, "--links")


def test_busy_seconds_is_the_union_of_in_flight_intervals():
    """busy_seconds(t0, t1): the part of [t0, t1] covered by at least one recorded
    transfer — overlapping intervals count once, partial overlaps are cut, gaps and
    intervals outside the window count nothing; old intervals are pruned."""
    assert union_seconds([(0, 2), (1, 3), (5, 6)], 0, 10) == 4
    assert union_seconds([(5, 6), (0, 2), (1, 3)], 1.5, 5.5) == pytest.approx(2.0)
    assert union_seconds([(0, 1)], 1, 2) == 0 and union_seconds([], 0, 1) == 0
    link = PacedLink(1e6, 0.0)
    T = 1e6                       # far from now: no pruning of these (KEEP_S after "now")
    assert link.busy_seconds(T, T + 10) == 0.0 and link.in_flight_until() == 0.0
    for s, d in ((T + 0, T + 2), (T + 1, T + 3), (T + 5, T + 6), (T + 20, T + 30)):
        link.record_transfer(s, d)
    assert link.busy_seconds(T, T + 10) == pytest.approx(4.0)          # union: 3 + 1
    assert link.busy_seconds(T + 2.5, T + 5.5) == pytest.approx(1.0)   # partial: .5 + .5
    assert link.busy_seconds(T + 3, T + 5) == 0.0                      # a gap
    assert link.busy_seconds(T + 6, T + 20) == 0.0                     # touching ends
    assert link.busy_seconds(T + 25, T + 26) == pytest.approx(1.0)     # inside one
    assert link.busy_seconds(T + 4, T + 3) == 0.0                      # empty window
    assert link.in_flight_until() == T + 30
    # an interval that ends early, recorded after one that ends late, is still seen
    link.record_transfer(T + 7, T + 8)
    assert link.busy_seconds(T + 6, T + 10) == pytest.approx(1.0)
    # intervals that ended more than KEEP_S ago are forgotten when one is recorded, once
    # PRUNE_MIN of them have gathered (not one at a time: that moved the whole list on
    # every collective), so the list stays under KEEP_S's worth + PRUNE_MIN
    import time
    from dhelix.links import paced
    now = time.perf_counter()
    stale = now - paced.KEEP_S - 5
    for n_old in (paced.PRUNE_MIN - 1, paced.PRUNE_MIN):
        old = PacedLink(1e6, 0.0)
        for i in range(n_old):
            old.record_transfer(stale + i * 1e-6, stale + 1 + i * 1e-6)
        old.record_transfer(now - 1, now - 0.5)
        # PRUNE_MIN - 1 old ones: all kept; PRUNE_MIN: all forgotten
        assert len(old._spans) == (n_old + 1 if n_old < paced.PRUNE_MIN else 1)
        assert old._spans[-1] == (now - 1, now - 0.5)
        assert old.busy_seconds(now - 2, now) == pytest.approx(0.5)
        assert old.busy_seconds(stale + 2, stale + 3) == 0.0
    assert old.stretched_s == 0.0 and old.stretched_ops == 0
    # a long run: a transfer every 10 ms for 200 s of "now" keeps at most KEEP_S's worth
    # of them + PRUNE_MIN, and busy_seconds over the last second is exact
    run = PacedLink(1e6, 0.0)
    longest = 0
    for i in range(20000):
        t = i * 0.01
        with run.lock:
            run._record(t, t + 0.004, t)
        longest = max(longest, len(run._spans))
    assert longest <= paced.KEEP_S / 0.01 + paced.PRUNE_MIN + 1
    assert run.busy_seconds(198.995, 199.995) == pytest.approx(100 * 0.004)


STRETCH_LINK = "paced:10mbit,20us"


def _stretch_run(slow, hook=None):
    env = {"DHELIX_LINK": f"{STRETCH_LINK},slow={slow}"}
    if hook:
        env["DHELIX_STRETCH_HOOK"] = hook
    return run_ranks(link_fns.stretch_gemms, 2, env=env, timeout=240)


def test_slow_stretches_gemms_that_overlap_a_transfer():
    """paced:10mbit,20us,slow=0.5 on 2 ranks, both hooks (kernel overrides, the default on
    this torch; the dispatch mode, forced): a chain of 200 GEMMs with no transfer in flight
    is charged nothing (0 in-flight seconds in its window, 0 GEMMs stretched); the same
    chain while an async all-gather (0.84 s modelled) is in flight is charged more than 0
    and at most slow x the window's in-flight seconds, and at least a quarter of that (the
    window is GEMMs, their stretch sleeps and a few us of Python per GEMM: about
    slow/(1+slow) of it); the sleeps paid the charge (within one batch, MIN_SLEEP_S);
    autograd's backward GEMMs are stretched while a transfer is in flight, the forward ones
    with none are not. With slow=0 nothing is installed or charged though the link records
    the same in-flight seconds. The values (GEMM chains, gathered tensors, gradients) are
    bit-identical with and without the stretch."""
    from dhelix.links.contention import MIN_SLEEP_S
    slow = 0.5
    runs = {"kernel": _stretch_run(slow), "mode": _stretch_run(slow, "mode"),
            "off": _stretch_run(0)}
    for name, res in runs.items():
        assert len(res) == 2, name
        for rank, r in enumerate(res):
            where = (name, rank, r)
            assert r["gathered"] and r["same_values"], where
            assert r["idle"]["collectives"] == 0 and r["idle"]["busy"] == 0.0, where
            assert r["idle"]["stretched"] == 0.0 and r["idle"]["ops"] == 0, where
            assert r["busy"]["busy"] > 0, where            # the all-gather was in flight
            assert r["backward"]["busy"] > 0, where
            assert r["forward"]["ops"] == 0 and r["forward"]["stretched"] == 0.0, where
            if name == "off":
                assert r["hook"] is None and r["link_hook"] is None and r["slow"] == 0.0
                assert r["total"] == {"stretched": 0.0, "ops": 0, "slept": 0.0}, where
                continue
            assert r["hook"] == r["link_hook"] == name and r["slow"] == slow, where
            b = r["busy"]
            assert 0 < b["ops"] <= 200, where
            assert 0.25 * slow * b["busy"] <= b["stretched"] <= slow * b["busy"] + 1e-9, where
            assert r["backward"]["ops"] >= 1 and r["backward"]["stretched"] > 0, where
            t = r["total"]
            assert t["ops"] == b["ops"] + r["backward"]["ops"], where
            assert t["slept"] >= t["stretched"] - MIN_SLEEP_S, where
        for rank in range(2):
            off = runs["off"][rank]
            assert torch.equal(res[rank]["y"], off["y"]), (name, rank)
            assert torch.equal(res[rank]["grad"], off["grad"]), (name, rank)


def test_paced_link_delays_to_the_model_holding_no_cpu():
    """On each of 2 ranks, an all-gather, an all-reduce and a reduce-scatter of 2-4 MiB over
    paced:100mbit,20us each take from 0.99x to 1.25x + 20 ms (slack for a loaded CI machine)
    of the modelled time (ring bytes / 100 Mbit/s + latency, 84-168 ms), while the process
    uses under a quarter of that wall time as CPU time (each timed after one untimed call:
    the first on a group maps its shared memory, ~3x the CPU of later ones); two
    all-reduces issued together queue on the FIFO link (the first ends after >= 0.99x one
    modelled time, both after >= 0.99x two); a ring step (send one way, receive the other) takes one transfer's
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


def test_training_over_the_paced_link_is_unchanged(tmp_path):
    """4 steps of TP=2+SP on 2 ranks, megatron and DHelix over paced:10mbit: on every rank
    the link was on (it paced > 0 collectives, modelled > 0 s of transfer) and slowed the
    run (its waits slept past the data's arrival: > 0 s; 1.1-1.9 s of the 2.07 s modelled
    when written), the run with DHELIX_LINK=none had no link, and the losses are
    bit-identical to that run's (pacing delays, never changes, a collective). DHelix once
    more with slow=0.5 (paced:10mbit,slow=0.5): its GEMMs that overlap a transfer were
    stretched (> 0 of them, > 0 s charged), the same collectives ran, and the losses are
    again bit-identical."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=4, global_batch_size=6, seq_length=32)
    # slow enough that the waits sleep: ~2 s of modelled transfer per rank for this run
    env = {"DHELIX_LINK": "paced:10mbit"}
    plain = run_ranks(train_result, 2, timeout=300, env={"DHELIX_LINK": "none"}, **kw)
    base = run_ranks(train_result, 2, timeout=300, env=env, **kw)
    trace = str(tmp_path / "t.json")
    dh = run_ranks(train_result, 2, timeout=300, env=env,
                   dhelix={"enabled": True, "trace": trace}, **kw)
    assert len(plain) == len(base) == len(dh) == 2
    for rank, (p, b, d) in enumerate(zip(plain, base, dh)):
        assert p["link"] is None, (rank, p["link"])
        for name, r in (("megatron", b), ("dhelix", d)):
            link = r["link"]
            assert link is not None, f"rank {rank} {name}: DHELIX_LINK was not installed"
            assert link["collectives"] > 0, (rank, name, link)
            assert link["modelled_s"] > 0, (rank, name, link)
            assert link["waited_s"] > 0, (rank, name, link)     # the link slowed the run
            assert link["peer_late_s"] >= 0 and link["peer_slot_s"] >= 0, (rank, name, link)
        same_numbers(b["losses"], p["losses"], tol=0.0, what=f"rank {rank} megatron losses")
        same_numbers(d["losses"], p["losses"], tol=0.0, what=f"rank {rank} dhelix losses")
    # the trace carries the link's transfers on their own track, and where the time went
    from dhelix.strand.trace import LINK_TID
    for rank in range(2):
        tr = json.load(open(tmp_path / f"t.rank{rank}.json"))
        xs = [e for e in tr["traceEvents"] if e.get("ph") == "X"]
        link = [e for e in xs if e["tid"] == LINK_TID]
        assert link and all(e["name"] == "transfer" for e in link), rank
        # 4 comm ops per layer forward, 6 per backward (tiny: 2 layers), and megatron's
        # own collectives (embedding, output layer, loss) between the layers
        assert len(link) > len([e for e in xs if e["tid"] in (1, 2)]), rank
        rows = {r["phase"]: r for r in tr["otherData"]["time_report"]}
        whole = rows["whole (traced)"]
        assert 0 < whole["link_busy"] <= 1 and 0 < whole["compute_busy"] <= 1, whole
        assert "F(2) ∥ B(1)" in rows and "between phases" in rows, sorted(rows)
        assert "| whole (traced) |" in open(tmp_path / f"t.rank{rank}.md").read()
    # contention: DHelix's executor and megatron's layers under the GEMM stretch hook
    slow = run_ranks(link_fns.train_with_stretch, 2, timeout=300,
                     env={"DHELIX_LINK": "paced:10mbit,slow=0.5"}, dhelix={"enabled": True},
                     **kw)
    assert len(slow) == 2
    for rank, (p, s) in enumerate(zip(plain, slow)):
        st = s["stretch"]
        assert st is not None and st["hook"] == "kernel", (rank, st)
        assert st["ops"] > 0 and st["stretched_s"] > 0, (rank, st)   # ~215 GEMMs, ~6 ms
        assert s["link"]["collectives"] == dh[rank]["link"]["collectives"], (rank, s["link"])
        same_numbers(s["losses"], p["losses"], tol=0.0,
                     what=f"rank {rank} dhelix losses with slow=0.5")


def test_shm_sums_are_left_to_right_on_three_ranks():
    """On a 3-rank group over the paced link (shared memory): all-reduce, reduce-scatter
    (both summed straight into the output) and all-gather equal, bit for bit, the sums
    rank 0 + rank 1 + rank 2 taken left to right and the gathered rows, on every rank; an
    all-reduce on a transposed (non-contiguous) buffer too; and they did go through shared
    memory (one segment group on each rank)."""
    for rank, r in enumerate(run_ranks(link_fns.shm_sums, 3, env={"DHELIX_LINK": PACED},
                                       timeout=120)):
        assert r["shm_groups"] == 1, (rank, r)
        for name in ("all_reduce", "all_reduce_noncontig", "reduce_scatter", "all_gather"):
            assert r[name] == 0, (rank, name, r)


def test_shm_slots_survive_waits_out_of_order():
    """A collective's shared-memory slot is reused only once every rank has read it, also
    when a rank waits for its collectives out of issue order (a DHelix reader order): its
    published "done" is the last collective up to which it has read them all. (It was the
    highest one read: a reordered plan on the paced link trained on a peer's later data,
    grad norm 5.8e7 against megatron's 2.5.)"""
    for rank, r in enumerate(run_ranks(link_fns.shm_waits_out_of_order, 2,
                                       env={"DHELIX_LINK": PACED}, timeout=120)):
        assert r == [0] * 5, (rank, r)


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


def test_waits_for_a_late_peer_are_counted():
    """The paced link counts what its model does not price (the trainer reports it as
    `link.peer_late_s` and `link.peer_slot_s`): a wait for a peer that posted 0.3 s late
    counts >= 0.25 s of lateness on the rank that waited and < 0.25 s on the late one; a
    fifth all-gather issued while the peer has read none of the four before it waits
    >= 0.25 s for a free slot on that rank only."""
    res = run_ranks(link_fns.late_peer, 2, env={"DHELIX_LINK": "paced:1000gbit"},
                    timeout=120)
    assert res[0]["late"][0] >= 0.25 and res[1]["late"][0] < 0.25, res
    assert res[0]["slot"][1] >= 0.25 and res[1]["slot"][1] < 0.25, res
    assert res[0]["slot"][0] < 0.25 and res[0]["late"][1] < 0.25, res


def test_sleep_until_never_returns_early():
    """The link's waits end at, never before, the modelled end, fine or coarse; a poll
    whose condition never holds calls its timeout."""
    import time
    from dhelix.links import clock
    try:
        for fine in (True, False):
            clock.FINE = fine
            for d in (0.0, 20e-6, 200e-6, 3e-3):
                t = time.perf_counter() + d
                clock.sleep_until(t)
                assert time.perf_counter() >= t, (fine, d)
        with pytest.raises(TimeoutError):
            clock.poll(lambda: False, time.monotonic() + 0.05,
                       lambda: (_ for _ in ()).throw(TimeoutError()))
    finally:
        clock.FINE = True


@pytest.mark.parametrize("eager", [True, False])
def test_a_posted_collective_is_read_at_the_next_issue(eager):
    """With `shm.EAGER` (the default) a rank reads every collective all ranks have posted
    at its next issue, so a peer reuses the slot without waiting for the reader: rank 0's
    fifth all-gather, issued while rank 1's reader of the first is 0.5 s away, waits
    < 0.25 s for its slot; without, >= 0.4 s. Every result is the gathered inputs, both
    ways."""
    res = run_ranks(link_fns.reads_posted_collectives, 2, eager,
                    env={"DHELIX_LINK": "paced:1000gbit"}, timeout=120)
    for r in res:
        assert r["wrong"] == [0] * 5, res
    if eager:
        assert res[0]["slot_s"] < 0.25, res
    else:
        assert res[0]["slot_s"] >= 0.4, res


def test_lanes_call_the_paced_link_directly():
    """DHelix's gloo lanes start their all-gathers and reduce-scatters on the paced link
    without torch.distributed's wrapper (`links/paced.py: direct`): the same results as
    through torch.distributed, each collective counted once and modelled alike; the
    default group (control traffic, not paced) never takes that path."""
    res = run_ranks(link_fns.direct_lanes, 2, env={"DHELIX_LINK": "paced:1gbit"},
                    timeout=120)
    for r in (0, 1):
        d, via_dist = res[r][True], res[r][False]
        assert res[r]["direct_for_group"] and not res[r]["direct_for_default"]
        assert torch.equal(d["ag"], via_dist["ag"]) and torch.equal(d["rs"], via_dist["rs"])
        assert d["count"] == via_dist["count"] == 2
        assert d["modelled"] == pytest.approx(via_dist["modelled"]) and d["modelled"] > 0
    x0 = torch.arange(24, dtype=torch.float32).view(6, 4)
    xs = [x0 * (r + 1) + 0.5 for r in (0, 1)]
    assert torch.equal(res[0][True]["ag"], torch.cat(xs))
    assert torch.equal(res[1][True]["rs"], (xs[0] + xs[1])[3:])


def test_profiled_host_times_leave_out_the_wait_for_the_modelled_end():
    """A comm op's host time (`dhelix profile`: issue + finish on the thread) is timed
    once the link's modelled end has passed: on a link slow enough that every transfer
    outlasts the ranks' barrier, every timed wait (3 repeats of each comm op) comes after
    its modelled end, so none sleeps or spins toward it (which the thread clock would
    count: ~45 µs a collective here). On the plain gloo lanes `dhelix profile` runs on
    (the strict ones wait on a lane's thread, not the one timed)."""
    env = {"DHELIX_LINK": "paced:10mbit", "DHELIX_LANES": "cpu"}
    for res in run_ranks(link_fns.profiled_host_times, 2, env=env, timeout=240):
        assert set(res["host_f"]) == {"ag_attn", "rs_attn", "ag_mlp", "rs_mlp"}
        values = list(res["host_f"].values()) + list(res["host_b"].values())
        assert all(0 < v < 1.0 for v in values)
        assert len(res["early_s"]) == 3 * len(values)
        assert max(res["early_s"]) <= 0.0
