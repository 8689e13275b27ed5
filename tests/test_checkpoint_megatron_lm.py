"""Checkpoints interchange with Megatron-LM's own training code (`$MEGATRON_LM`, else
../shared/megatron-lm; skipped without a checkout, failed under CI=true): torch_dist.

The Megatron-LM side is its real code on 2 gloo ranks, driven as megatron_lm_fns drives
train_step: its argument parser and globals, model_provider/gpt_builder's GPT
(--transformer-impl local: megatron-core's local spec, DotProductAttention), megatron
DDP, its optimizer and scheduler (get_megatron_optimizer_config,
get_optimizer_param_scheduler), the forward-backward function train_step gets with
pretrain_gpt's loss_func, and megatron.training.checkpointing's save_checkpoint /
load_checkpoint (CPU stand-ins for torch.cuda in those modules only:
checkpoint_megatron_lm_fns._cpu_checkpointing). The model is configs/models/tiny.yaml
under Megatron-LM's flags; the optimizer and schedule are `dhelix train`'s defaults
(Adam, constant lr, no weight decay or clipping), the schedule 3 iterations long, on both
sides. Both programs train and evaluate on the same tokens: `dhelix train`'s data (its
corpus, seed 1234), which the Megatron-LM side reads at its own data position
(`consumed_train_samples`, which the checkpoint carries).

  Megatron-LM -> dhelix   TP=2. Megatron-LM trains 3 iterations; save_checkpoint writes
                          iteration 2. `dhelix train --load` (model, optimizer, scheduler,
                          RNG, data position) with --train-iters 2 evaluates where the save
                          stands; with --train-iters 3 it first trains iteration 3 itself.
                          Its eval losses against Megatron-LM's after iterations 2 and 3.
  dhelix -> Megatron-LM   DP=2, the distributed optimizer. `dhelix train --save` for 2
                          iterations (and the same run to 3, unsaved, the reference);
                          Megatron-LM's load_checkpoint (model, optimizer, scheduler, RNG;
                          not --finetune) into a model initialised from another seed, which
                          resumes at iteration 2, data position 16 samples, Adam's step 2,
                          and trains iteration 3 itself. Its eval losses against dhelix's
                          after iterations 2 and 3.

An eval loss is the mean over the eval batch's micro-batches and DP ranks of each
micro-batch's token mean, formed the trainer's way on both sides. The two programs' layer
code differs (megatron's DotProductAttention and LayerNorm module against DHelix's
SDPAttention and Norm: the same math), so the losses are held to TOL relative, not bit for
bit; on this CPU they come out bit-identical. A load that loses the optimizer state moves
the loss after iteration 3 by 1.4e-3 relative, the wrong data position or a fresh model
the losses by 2e-2 and more.
"""

from dhelix.testing import run_ranks
import checkpoint_megatron_lm_fns as fns
import megatron_lm_fns
from compare import same_numbers

ML = megatron_lm_fns.require_megatron_lm()

TOL = 1e-5
ITERS = [fns.SAVED, fns.STEPS]
LOCAL_SPEC = ["LayerNorm", "DotProductAttention"]     # Megatron-LM's layer, not DHelix's


def _same_evals(got, want, what):
    """Per rank: {iteration: eval loss} at ITERS, against the other program's."""
    assert len(got) == len(want) == 2
    for rank, (g, w) in enumerate(zip(got, want)):
        assert sorted(g) == sorted(w) == ITERS, (g, w)
        same_numbers([g[n] for n in ITERS], [w[n] for n in ITERS], TOL,
                     f"rank {rank}: {what}, eval loss after iterations {ITERS}")


def test_megatron_lm_checkpoint_loads_in_dhelix_train(tmp_path):
    root = tmp_path / "megatron-lm"
    ml = run_ranks(fns.megatron_lm_saves, 2, str(root), ["--tensor-model-parallel-size", "2"],
                   timeout=300)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == str(fns.SAVED)
    assert all(r["modules"] == LOCAL_SPEC for r in ml)
    dh = run_ranks(fns.dhelix_loads, 2, str(root), tensor_model_parallel_size=2, timeout=300)
    _same_evals(dh, [r["evals"] for r in ml], "dhelix train (loaded) vs Megatron-LM")


def test_dhelix_checkpoint_loads_in_megatron_lm(tmp_path):
    root = tmp_path / "dhelix"
    dh = run_ranks(fns.dhelix_saves, 2, str(root), use_distributed_optimizer=True,
                   timeout=300)
    ml = run_ranks(fns.megatron_lm_loads, 2, str(root), ["--use-distributed-optimizer"],
                   timeout=300)
    for r in ml:
        assert r["modules"] == LOCAL_SPEC and r["distributed_optimizer"]
        assert (r["iteration"], r["consumed"], r["scheduler_steps"], r["adam_steps"]) == (
            fns.SAVED, fns.SAVED * fns.GBS, fns.SAVED * fns.GBS, [float(fns.SAVED)])
    _same_evals([r["evals"] for r in ml], dh, "Megatron-LM (loaded) vs dhelix train")
