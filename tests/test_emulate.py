"""Paced compute (`dhelix/links/emulate.py`): a small model's DHelix layer step run on 2
ranks (TP=2+SP, tiny-llama, seq 64, mbs 2) while the ranks keep the time of llama-8b
(seq 4096, mbs 1) on the A40 cluster model, 8 times slower (`paced:a40,x=8`), under the
trivial and the paired plan.

Asserted (what holds whatever the machine's noise): every output and gradient equals the
unpaced step's, bit for bit (pacing only waits); every compute op was paced; each step
lasted at least the emulated compute of both strands (compute is serial, each op waits
out its emulated time); the TP collectives were priced at the emulated shape's bytes (the
ratio of the two shapes' all-gather sizes); bad flags are one message each. How close the
emulated step time comes to the layer simulator's prediction is a measurement, not a
test (no timing thresholds in tests): `python scripts/emulate_layer_step.py` prints it
(docs/links.md has the numbers).
"""
import pytest

from dhelix.testing import run_ranks
from emulate_fns import layer_step, train_paced_and_not

SMALL, BIG = "tiny-llama", "llama-8b,seq=4096,mbs=1"


@pytest.mark.timeout(600)
def test_paced_layer_step_keeps_emulated_time_and_results():
    r = run_ranks(layer_step, 2, SMALL, BIG, "paced:a40,x=8", 64, 2, 2, timeout=500,
                  env={"DHELIX_LINK": "paced:1gbit"})
    for x in r:
        assert x["same"] == {"trivial": True, "paired": True}
        assert x["paced_ops"] > 0
        for plan in ("trivial", "paired"):
            assert x["min"][plan] >= x["compute_s"][plan], (plan, x)
            assert x["predicted"][plan] > x["compute_s"][plan] * 0.5
        # the TP group's bytes scaled to the emulated shape's: tokens × hidden × dtype
        # bytes, bf16 there and fp32 here: (4096·1·4096·2)/(64·2·64·4)
        assert x["byte_scale"] == [pytest.approx(4096 * 4096 * 2 / (64 * 2 * 64 * 4))]


@pytest.mark.timeout(600)
def test_paced_training_changes_no_result():
    """`dhelix train --dhelix` with paced compute: the same losses and final weights as
    without, bit for bit; the emulation's report (step, tokens/s, own share) is there."""
    from compare import same_checksums, same_numbers
    r = run_ranks(train_paced_and_not, 2, timeout=500, config="tiny-llama",
                  tensor_model_parallel_size=2, sequence_parallel=True, train_iters=3,
                  checksums=True, dhelix={"enabled": True}, env={"DHELIX_LINK": "paced:1gbit"})
    for plain, paced in r:
        same_numbers(paced["losses"], plain["losses"], 0.0, "losses")
        same_checksums(paced["weight_checksums"], plain["weight_checksums"], 0.0, "weights")
        e = paced["emulation"]
        assert plain["emulation"] is None and e["paced_ops"] > 0 and e["step_s"] > 0
        assert e["emulate"] == "llama-8b,seq=1024,mbs=1".split(",")[0] and e["factor"] == 2


@pytest.mark.parametrize("compute,emulate,msg", [
    ("paced:a40,x=0.5", "llama-8b", "x=0.5 would ask the small ops to run faster"),
    ("paced:a40", "", "needs --emulate MODEL"),
    ("paced:a40", "llama-8b,seq=abc", "use seq=S and mbs=B"),
    ("fast", "llama-8b", "use paced:CLUSTER[,x=FACTOR]"),
])
def test_bad_flags_are_one_message(compute, emulate, msg):
    from dhelix.links.emulate import EmulationError, parse
    with pytest.raises(EmulationError, match=msg.replace("[", r"\[").replace("]", r"\]")
                       .replace("(", r"\(")):
        parse(compute, emulate)
    assert parse("none", "") is None
