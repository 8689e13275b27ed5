"""Strict lanes (dhelix/strand/strict.py): gloo kept to CUDA's and NCCL's rules. Each bug
class a GPU would show is reproduced in its smallest form and caught here, and plain gloo
is shown to hide it. The rest of the suite runs on strict lanes too (tests/conftest.py);
the last tests here keep the plain gloo lanes (`DHELIX_LANES=cpu`) covered."""
import time

import pytest

from dhelix.testing import RankError, run_ranks
import strict_fns as F
from compare import same_runs
from train_fns import train_result


def test_the_suite_runs_on_strict_lanes():
    assert run_ranks(F.lanes_in_use, 1, timeout=120) == ["StrictLanes"]
    assert run_ranks(F.lanes_in_use, 1, timeout=120, env={"DHELIX_LANES": "cpu"}) == \
        ["CpuLanes"]


def test_a_dropped_comm_input_is_caught():
    """Class 1 (the old CudaLanes recorded only the output): the caller lets the input of
    a reduce-scatter go right after launch. Kept by the lane: the right values."""
    got = run_ranks(F.lost_input, 2, timeout=120, keep=False)
    # every rank fails; a rank whose peer failed first may see the lost peer instead
    assert all(status == "error" for status, _ in got)
    assert any("rs_attn (intra lane): its input 0 [8]" in msg and
               ("let go by the caller" in msg or "was freed" in msg) for _, msg in got)
    got = run_ranks(F.lost_input, 2, timeout=120, keep=True)
    # sum of [0..7] and [100..107], rank r keeps rows 4r..4r+3
    assert got == [("ok", [100.0, 102.0, 104.0, 106.0]), ("ok", [108.0, 110.0, 112.0, 114.0])]


def test_a_comm_input_written_before_the_wait_is_caught():
    got = run_ranks(F.written_input, 2, timeout=120)
    assert all(status == "error" for status, _ in got)
    assert any("ag_mlp (intra lane): its input 0 [4] was modified in place" in msg
               for _, msg in got)


@pytest.mark.parametrize("seed", [0, 1])
def test_the_old_lane_fails_in_the_real_layer(seed):
    """The same class in the program: a DHelix layer step whose lane keeps nothing but
    the output fails, naming the comm op whose input its caller dropped."""
    got = run_ranks(F.old_lane_in_a_layer, 2, timeout=300, plan_seed=seed)
    assert all(status == "error" for status, _ in got)
    assert any(msg.split(" ")[0] in ("rs_attn", "rs_mlp", "rs_attn_b", "rs_mlp_b") and
               "its input 0" in msg and ("let go by the caller" in msg or "was freed" in msg)
               for _, msg in got), got


def test_crossed_p2p_deadlocks_on_strict_lanes_and_not_on_gloo():
    """Class 3: two ranks that each receive before sending. gloo (async, matched by tag)
    lets it pass; on NCCL a blocking receive holds the lane stream, so it deadlocks. The
    strict lanes' watchdog reports it within seconds on each rank, naming the lane, the
    op it waits in, the peer and what is held behind it. One batch per rank is fine."""
    assert run_ranks(F.crossed_p2p, 2, timeout=120, strict=False, batched=False) == \
        [[2.0] * 4, [1.0] * 4]
    t = time.time()
    with pytest.raises(RankError) as e:
        run_ranks(F.crossed_p2p, 2, timeout=120, strict=True, batched=False)
    msg = str(e.value)
    assert time.time() - t < 60
    assert "LaneDeadlock" in msg and "a deadlock" in msg
    assert "intra lane: waits in p2p_recv (recv #0 from rank" in msg
    assert "held behind it: p2p_send (send #0 to rank" in msg
    assert run_ranks(F.crossed_p2p, 2, timeout=120, strict=True, batched=True) == \
        [[2.0] * 4, [1.0] * 4]


def test_p2p_posted_in_another_order_is_an_error():
    """NCCL matches point-to-point messages in posting order, never by tag."""
    assert run_ranks(F.reordered_p2p, 2, timeout=120, strict=False) == \
        ["ok", "ok"]      # the plain gloo lanes match by tag, so it passes there
    with pytest.raises(RankError, match="in posting order, not by tag"):
        run_ranks(F.reordered_p2p, 2, timeout=120, strict=True)


def test_plain_gloo_lanes_still_train_like_megatron():
    """The default CPU lanes (no DHELIX_LANES) stay covered: TP=2+SP, the paired plan,
    bit-identical to megatron."""
    kw = dict(config="tiny", tensor_model_parallel_size=2, sequence_parallel=True,
              train_iters=3, global_batch_size=6, checksums=True, env={"DHELIX_LANES": "cpu"})
    base = run_ranks(train_result, 2, timeout=300, **kw)
    dh = run_ranks(train_result, 2, timeout=300, dhelix={"enabled": True}, **kw)
    assert same_runs(dh, base) == 0.0
