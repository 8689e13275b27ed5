"""Rank functions of tests/test_checkpoint_megatron_lm.py: Megatron-LM's save_checkpoint /
load_checkpoint (torch_dist) driving the harness of megatron_lm_fns, and `dhelix train`."""
import importlib
import multiprocessing
from functools import partial

import torch

import megatron_lm_fns as fns
from dhelix.train.trainer import TrainConfig, train

STEPS = 3            # the run: 3 iterations, the checkpoint at iteration 2
SAVED = 2
GBS = 8
# configs/models/tiny.yaml under Megatron-LM's flags (later flags win over SMALL's);
# NullTokenizer adds one token: --vocab-size 511 pads to tiny's 512. The optimizer and
# schedule are `dhelix train`'s defaults: Adam, lr 1e-3 constant, no weight decay, no
# clipping; the schedule STEPS long on both sides (its state must match to load).
ARGV = fns.SMALL + ["--ffn-hidden-size", "256", "--max-position-embeddings", "256",
                    "--global-batch-size", str(GBS), "--train-iters", str(STEPS),
                    "--lr-decay-style", "constant", "--weight-decay", "0",
                    "--clip-grad", "0", "--ckpt-format", "torch_dist"]
DHELIX = dict(config="tiny", global_batch_size=GBS, lr_decay_iters=STEPS, eval_iters=1,
              quiet=True)


# ---- Megatron-LM's side ---------------------------------------------------------------

def _cpu_checkpointing():
    """What Megatron-LM's checkpointing needs on a CPU-only torch, beyond dhelix.compat.cpu:
    in its checkpointing module and the fully parallel save's exchange, `torch.cuda`
    answers for the CPU (dhelix.compat.cpu's view), with no CUDA generator (its state an
    empty tensor, setting it a no-op); the writer's workers may log memory without psutil;
    and the writer forks, which a daemonic rank process may not."""
    from dhelix.compat.cpu import _TorchView
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    class View(_TorchView):
        def __init__(self):
            super().__init__()
            self.cuda.get_rng_state = lambda *a, **k: torch.empty(0, dtype=torch.uint8)
            self.cuda.set_rng_state = lambda *a, **k: None
            self.cuda.empty_cache = lambda *a, **k: None
    for name in ("megatron.training.checkpointing",
                 "megatron.core.dist_checkpointing.strategies.fully_parallel",
                 "megatron.core.dist_checkpointing.exchange_utils"):
        mod = importlib.import_module(name)
        if mod.torch is torch:
            mod.torch = View()
    if not filesystem_async.HAVE_PSUTIL:
        filesystem_async._process_memory = lambda: 0
    multiprocessing.current_process()._config["daemon"] = False


def _megatron_lm(argv, seed):
    """Megatron-LM's args and globals (fns.init_megatron), and what its
    setup_model_and_optimizer builds: model_provider/gpt_builder's GPT (the local spec),
    megatron DDP, its optimizer (get_megatron_optimizer_config) and scheduler
    (get_optimizer_param_scheduler); the weights initialised from `seed`."""
    args = fns.init_megatron(ARGV + argv)
    _cpu_checkpointing()
    import gpt_builders
    import megatron.training.training as training
    import model_provider as mp
    from megatron.core.distributed import (DistributedDataParallel,
                                           DistributedDataParallelConfig, finalize_model_grads)
    from megatron.core.optimizer import get_megatron_optimizer
    from dhelix.compat.cpu import cuda_type_names
    assert args.padded_vocab_size == 512
    torch.manual_seed(seed)
    gpt = mp.model_provider(gpt_builders.gpt_builder, pre_process=True, post_process=True)
    ddp = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer)
    model = DistributedDataParallel(config=gpt.config, ddp_config=ddp, module=gpt)
    gpt.config.no_sync_func = model.no_sync
    gpt.config.finalize_model_grads_func = finalize_model_grads
    ocfg, overrides = training.get_megatron_optimizer_config(args)
    with cuda_type_names():
        opt = get_megatron_optimizer(ocfg, [model], overrides)
    return args, model, opt, training.get_optimizer_param_scheduler(opt)


def _modules(model):
    """The classes of the first layer's norm and core attention."""
    layer = model.module.decoder.layers[0]
    return [type(layer.input_layernorm).__name__,
            type(layer.self_attention.core_attention).__name__]


def _batches(args):
    """This DP rank's micro-batches of the next global batch of `dhelix train`'s data (its
    corpus, its seed) at Megatron-LM's data position (`args.consumed_train_samples`, which
    a checkpoint carries): the tokens both programs train and evaluate on."""
    from megatron.core import parallel_state as ps
    from dhelix.train.data import make_batches
    nmb = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    it = make_batches("corpus", seq_length=args.seq_length,
                      micro_batch_size=args.micro_batch_size, num_microbatches=nmb,
                      vocab_size=args.padded_vocab_size, seed=args.seed,
                      dp_rank=ps.get_data_parallel_rank(), dp_size=args.data_parallel_size,
                      start_step=args.consumed_train_samples // args.global_batch_size)
    return [next(it) for _ in range(nmb)]


def _forward_backward(args, model, batches, opt=None):
    """The forward-backward function Megatron-LM's train_step gets, with pretrain_gpt's
    loss, inside the rerun state machine's loop as train_step calls it; forward only
    without an optimizer."""
    import megatron.training.training as training
    import pretrain_gpt
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine

    def forward_step(data_iterator, model):
        b = next(data_iterator)
        out = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                    loss_mask=b["loss_mask"])
        return out, partial(pretrain_gpt.loss_func, b["loss_mask"], model=model)
    data = RerunDataIterator(iter(batches))
    rerun = get_rerun_state_machine()
    while rerun.should_run_forward_backward(data):
        if opt is not None:
            model.zero_grad_buffer()
            opt.zero_grad()
        out = training.get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=data, model=[model],
            num_microbatches=len(batches), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=opt is None)
    return out


def _train_step(args, model, opt, sched):
    """One iteration as train_step runs it: forward-backward, the optimizer's step, the
    scheduler's by the global batch, and the data position (as training.train counts)."""
    from dhelix.compat.cpu import cuda_type_names
    _forward_backward(args, model, _batches(args), opt)
    with cuda_type_names():
        assert opt.step()[0]
    sched.step(increment=args.global_batch_size)
    args.consumed_train_samples += args.global_batch_size


def _eval_loss(args, model):
    """The Megatron-LM model's loss on what `dhelix train` evaluates on at this data
    position (eval_iters 1: the next global batch): each micro-batch's token mean from
    pretrain_gpt's [loss sum, tokens], reduced over micro-batches and DP by the trainer's
    own `_average_loss`, so that both programs' numbers are formed the same way."""
    from dhelix.train.trainer import _average_loss
    model.eval()
    with torch.no_grad():
        out = _forward_backward(args, model, _batches(args))
    model.train()
    return _average_loss([(o["lm loss"][0] / o["lm loss"][1]).item() for o in out],
                         torch.device("cpu"), None)


def megatron_lm_saves(root, argv):
    """Megatron-LM trains STEPS iterations; after SAVED, megatron.training.checkpointing.
    save_checkpoint(SAVED, ...) writes `root`. Its eval losses after SAVED and after STEPS."""
    args, model, opt, sched = _megatron_lm(argv + ["--save", root, "--save-interval",
                                                   str(SAVED)], seed=1234)
    import megatron.training.training as training
    from megatron.training.checkpointing import save_checkpoint
    evals = {}
    for it in range(1, STEPS + 1):
        _train_step(args, model, opt, sched)
        if it == SAVED:             # as training.train saves at --save-interval
            save_checkpoint(SAVED, [model], opt, sched, 0.0, preprocess_common_state_dict_fn=
                            training.preprocess_common_state_dict)
        if it >= SAVED:
            evals[it] = _eval_loss(args, model)
    return {"evals": evals, "modules": _modules(model)}


def megatron_lm_loads(root, argv):
    """Megatron-LM's load_checkpoint (model, optimizer, scheduler, RNG) of the save under
    `root` into a model initialised from another seed; its eval loss there, and after one
    more iteration of its own training."""
    args, model, opt, sched = _megatron_lm(argv + ["--load", root], seed=4321)
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.training.checkpointing import load_checkpoint
    # megatron-core 0.16.1 without Apex/TE (torch's Adam): the distributed optimizer's load
    # asserts one Adam `step` over every parameter's state, which a fresh optimizer has not
    # made; then copies each parameter's own (fresh) step over the loaded one. The same
    # before/after fix-up as `dhelix train`'s (dhelix.train.optim.TrainOptimizer).
    from dhelix.train.optim import TrainOptimizer
    fix = TrainOptimizer(opt, sched)
    fix.before_load()
    with torch.no_grad():       # main weights are views of the (leaf) model weights
        iteration, _ = load_checkpoint([model], opt, sched)
    fix.after_load()
    adam_steps = sorted({float(st["step"]) for o in getattr(opt, "chained_optimizers", [opt])
                         for st in o.optimizer.state.values()})
    out = {"modules": _modules(model), "iteration": iteration,
           "consumed": args.consumed_train_samples,
           "adam_steps": adam_steps, "scheduler_steps": sched.num_steps,
           "distributed_optimizer": all(isinstance(o, DistributedOptimizer) for o in
                                        getattr(opt, "chained_optimizers", [opt])),
           "evals": {iteration: _eval_loss(args, model)}}
    for it in range(iteration + 1, STEPS + 1):
        _train_step(args, model, opt, sched)
        out["evals"][it] = _eval_loss(args, model)
    return out


# ---- dhelix train's side --------------------------------------------------------------

def dhelix_loads(root, **kw):
    """`dhelix train --load root` (model, optimizer, scheduler, RNG, data position) to
    --train-iters SAVED (nothing trained: evaluated where the save stands) and to STEPS
    (one iteration trained from the loaded state): the eval losses."""
    return {n: train(TrainConfig(load=root, train_iters=n, **DHELIX, **kw))["eval_loss"]
            for n in (SAVED, STEPS)}


def dhelix_saves(root, **kw):
    """`dhelix train --save root` for SAVED iterations, and the same run to STEPS unsaved
    (the reference for one more iteration): the eval losses."""
    saved = train(TrainConfig(save=root, train_iters=SAVED, **DHELIX, **kw))
    return {SAVED: saved["eval_loss"],
            STEPS: train(TrainConfig(train_iters=STEPS, **DHELIX, **kw))["eval_loss"]}
