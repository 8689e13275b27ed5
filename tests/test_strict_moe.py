"""DHELIX_LANES=strict and the MoE dispatcher's device-to-host copies (issue 21, item 2).

megatron's all-to-all dispatcher copies its counts (split sizes, tokens per expert) to the
host without blocking and synchronizes the event recorded after them at its sync point,
with EP > 1 inside `token_dispatch`, which DHelix never calls. In strict mode the CPU
compat layer keeps such a copy poison until its event is synchronized, as CUDA may: the
DHelix MoE layer must synchronize the strand's own event before it reads a count."""
import numpy as np
import pytest

from dhelix.testing import run_ranks

STRICT = {"DHELIX_LANES": "strict"}
NOT_SYNCED = ("read on the host before the device-to-host copy's event (the MoE "
              "dispatcher's d2h_event) was synchronized")


def test_strict_d2h_copy_is_poison_until_its_event_is_synchronized(monkeypatch):
    """One process, megatron's own copy function as its dispatcher calls it: in strict
    mode the host copies (a numpy array, a tensor) read as the poison until the event
    recorded after them is synchronized, then hold the values the source had when copied,
    in the same objects; the stream's synchronize delivers too. Without strict mode a
    copy is the source itself and the event the always-complete stream, as before."""
    import torch

    from dhelix.compat import cpu
    if not cpu.apply():
        pytest.skip("the CPU compat layer applies only without CUDA")
    from megatron.core.transformer.moe import token_dispatcher as td
    stream = td.MoEAlltoAllTokenDispatcher.cuda_dtoh_stream or cpu._NoStream()
    splits, tpe = torch.tensor([3, 0, 5]), torch.tensor([2, 6])

    monkeypatch.setenv("DHELIX_LANES", "strict")
    host_splits = td.maybe_move_tensor_to_cpu(splits, as_numpy=True, record_stream=False)
    host_tpe = td.maybe_move_tensor_to_cpu(tpe)
    assert td.maybe_move_tensor_to_cpu(None, as_numpy=True) is None
    ev = stream.record_event()
    splits.add_(100)                       # after the copy: the host copy must not see it
    assert isinstance(host_splits, np.ndarray) and (host_splits == cpu.D2H_POISON).all()
    assert host_tpe is not tpe and (host_tpe == cpu.D2H_POISON).all()
    assert not ev.query()
    ev.synchronize()
    assert ev.query()
    assert host_splits.tolist() == [3, 0, 5] and host_tpe.tolist() == [2, 6]
    ev.synchronize()                       # again: nothing changes
    assert host_splits.tolist() == [3, 0, 5]

    recorded = td.maybe_move_tensor_to_cpu(tpe, as_numpy=True)
    ev2 = stream.record_event()
    unrecorded = td.maybe_move_tensor_to_cpu(tpe)
    assert (recorded == cpu.D2H_POISON).all() and (unrecorded == cpu.D2H_POISON).all()
    stream.synchronize()                   # the whole stream: recorded or not
    assert recorded.tolist() == unrecorded.tolist() == [2, 6] and ev2.query()

    monkeypatch.setenv("DHELIX_LANES", "auto")
    assert td.maybe_move_tensor_to_cpu(tpe) is tpe
    arr = td.maybe_move_tensor_to_cpu(tpe, as_numpy=True)
    assert arr.tolist() == [2, 6] and np.shares_memory(arr, tpe.numpy())
    assert stream.record_event() is stream


SPLITS_NOT_SYNCED = "a2a_dispatch: all-to-all split sizes " + NOT_SYNCED


@pytest.mark.parametrize("variant,fn,ep,error", [
    ("none", "strict_moe_layer_matches", 2, SPLITS_NOT_SYNCED),
    ("dispatcher", "interleaved_moe_forwards", 2, SPLITS_NOT_SYNCED),
    ("unsnapshotted", "interleaved_moe_forwards", 1, None)],
    ids=["ep2-no-sync", "ep2-dispatcher-event-not-the-strands", "ep1-event-not-snapshotted"])
def test_reading_counts_before_the_d2h_sync_fails_in_strict_mode(variant, fn, ep, error):
    """The check can fail. EP=2 on 2 ranks: the old behaviour back (no synchronize
    before the dispatch all-to-all), and a half fix (synchronizing the dispatcher's
    current event, which the other strand's permute has replaced) both stop at
    a2a_dispatch with the error naming the op and the unsynchronized copy. EP=1 on one
    rank with the event left out of the strand's snapshot: megatron's own sync point in
    dispatch_postprocess waits for the other strand's event, and megatron's sort by
    local expert fails on the poison (its error, showing the poison value)."""
    import moe_fns
    from dhelix.compat.cpu import D2H_POISON
    kw = dict(plans=0) if fn == "strict_moe_layer_matches" else {}
    rs = run_ranks(getattr(moe_fns, fn), ep, timeout=300, env=STRICT, broken=variant, ep=ep,
                   **kw)
    for msg in rs:
        assert msg is not None, "the strict check did not fire"
        assert msg.startswith(error) if error else str(D2H_POISON) in msg, msg


@pytest.mark.parametrize("plans,zero", [(6, False), (2, True)],
                         ids=["ep2", "ep2-all-to-one-rank"])
def test_dhelix_moe_layer_matches_megatron_in_strict_mode(plans, zero):
    """EP=2 on 2 ranks, DHELIX_LANES=strict: output, input grad and every parameter
    grad equal megatron's MoE layer bit for bit for the trivial, paired and random legal
    plans (2 local experts each: tokens_per_expert is read too); also with every token
    routed to one rank's experts (zero split sizes and zero tokens per expert)."""
    import moe_fns
    rs = run_ranks(moe_fns.strict_moe_layer_matches, 2, timeout=300, env=STRICT, tp=1,
                   ep=2, plans=plans, zero_router=zero)
    for r in rs:
        assert r["plans"] == plans + 2 and len(r["a2a"]) == 4, r


@pytest.mark.parametrize("ep,mode", [(2, "strict"), (1, "strict"), (2, "auto")],
                         ids=["ep2", "ep1", "ep2-not-strict"])
def test_interleaved_moe_forwards_use_their_own_d2h_event(ep, mode):
    """Two strands' forwards of one MoE layer interleaved at the permute (the second
    permute replaces the dispatcher's routing and d2h event), strict, EP=2 on 2 ranks
    (DHelix's sync before a2a_dispatch) and EP=1 on one (megatron's own sync inside
    dispatch_postprocess): each output equals megatron's for its input bit for bit — the event
    travels in the strand's snapshot. Without strict mode as well (always-complete
    events, as before)."""
    import moe_fns
    rs = run_ranks(moe_fns.interleaved_moe_forwards, ep, timeout=300,
                   env={"DHELIX_LANES": mode}, ep=ep)
    assert rs == [0.0] * ep


def test_dhelix_moe_layer_tp2_ep2_matches_megatron_in_strict_mode():
    """TP=2+SP × EP=2 on 4 ranks (experts whole), strict: the trivial, paired and 2
    random plans equal megatron's MoE layer."""
    import moe_fns
    rs = run_ranks(moe_fns.strict_moe_layer_matches, 4, timeout=400, env=STRICT, tp=2,
                   ep=2, plans=2)
    assert all(r["plans"] == 4 for r in rs), rs


def test_shared_experts_racing_a_lane_collective_is_caught():
    """TP=2+SP × EP=2 with shared experts: megatron's shared-expert linears run their own
    TP collectives inside an op. Issued while a lane's TP comm is in flight they may run
    in different orders on different ranks under NCCL (this hung the strict suite before
    the fix); strict lanes refuse it by name. With `quiesce` first: equal to megatron."""
    import moe_fns
    rs = run_ranks(moe_fns.shared_experts_racing_the_lane, 4, timeout=400, env=STRICT,
                   tp=2, ep=2, plans=2, shared=96)
    assert all(r and "in flight" in r and "Lanes.quiesce(group)" in r for r in rs), rs
    rs = run_ranks(moe_fns.strict_moe_layer_matches, 4, timeout=400, env=STRICT, tp=2,
                   ep=2, plans=2, shared=96)
    assert all(r["plans"] == 4 for r in rs), rs
