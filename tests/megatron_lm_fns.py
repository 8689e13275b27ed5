"""Per-rank bodies of the tests against Megatron-LM's real training code."""
import contextlib
import os
import sys

import torch

SMALL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2",
         "--global-batch-size", "8", "--train-iters", "3", "--lr", "1e-3", "--mock-data",
         "--tokenizer-type", "NullTokenizer", "--vocab-size", "511",
         "--distributed-backend", "gloo", "--transformer-impl", "local",
         "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
         "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-persist-layer-norm",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--seed", "1234",
         "--rerun-mode", "disabled"]   # its validation mode saves CUDA RNG states


def megatron_lm_path():
    return os.environ.get("MEGATRON_LM") or os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "shared", "megatron-lm")


def require_megatron_lm() -> str:
    """The Megatron-LM checkout the tests drive; a test module without one is skipped
    (failed under CI=true, where ../shared/megatron-lm must be there)."""
    import pytest
    path = megatron_lm_path()
    if not os.path.exists(os.path.join(path, "pretrain_gpt.py")):
        msg = (f"no Megatron-LM checkout at {path}: set MEGATRON_LM to one (tag "
               f"core_v0.16.1 pairs with megatron-core 0.16.1)")
        if os.environ.get("CI") == "true":
            pytest.fail(msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)
    return path


def init_megatron(argv):
    """Megatron-LM's own argument parsing, validation and globals (with DHelix's
    extra_args_provider); then what `_initialize_distributed` does only when CUDA devices
    exist: the model-parallel groups and seeds, on the process group the test started."""
    sys.path.insert(0, megatron_lm_path())
    from dhelix.compat import cpu
    cpu.apply()
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.training import get_args
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.initialize import initialize_megatron
    from dhelix.megatron.args import add_dhelix_args
    destroy_global_vars()
    # validate_args asks the GPU's architecture when TP > 1 (a CUDA call standing in the
    # way on CPU): answer as a Hopper GPU would
    import megatron.training.arguments as margs
    margs.get_device_arch_version = lambda: 9
    sys.argv = ["pretrain_gpt.py"] + list(argv)
    if hasattr(margs, "parse_and_validate_args"):
        # core_v0.19: pretrain_gpt.py parses first, then pretrain() initializes
        margs.parse_and_validate_args(extra_args_provider=add_dhelix_args)
        initialize_megatron(allow_no_cuda=True, skip_mpu_initialization=True)
    else:
        initialize_megatron(extra_args_provider=add_dhelix_args, allow_no_cuda=True,
                            skip_mpu_initialization=True)
    args = get_args()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        args.tensor_model_parallel_size,
        context_parallel_size=args.context_parallel_size)
    model_parallel_cuda_manual_seed(args.seed)
    return args


def parsed(argv):
    args = init_megatron(argv)
    return {k: getattr(args, k) for k in ("dhelix", "dhelix_plan", "dhelix_trace",
                                          "transformer_impl", "tensor_model_parallel_size",
                                          "micro_batch_size", "global_batch_size")}


def checksums(model, attr):
    """name -> [sum, sum of squares] (float64) of each parameter's `attr` ("main_grad":
    what megatron DDP accumulated and reduced; "data": the weight), this rank's shard — the
    format of dhelix/train/trainer.py's `checksums`. Names are the GPT model's own
    (`decoder.layers.0.self_attention.linear_qkv.weight`), the same for megatron's layer and
    the DHelix layer (same submodules, same parameters). Every parameter must have one."""
    out = {}
    for name, p in model.module.named_parameters():
        t = getattr(p, attr, None)
        if t is None:
            raise AssertionError(f"{name} has no {attr}")
        t = t.detach().double()
        out[name] = [t.sum().item(), (t * t).sum().item()]
    return out


def cp_batch(batch):
    """pretrain_gpt's get_batch: this CP rank's two chunks (megatron-core's function; from
    0.19 it asks whether CP is hybrid, which pretrain_gpt answers from its flags)."""
    import inspect
    from megatron.core import parallel_state
    from megatron.core.utils import get_batch_on_this_cp_rank
    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False,
                                         cp_group=parallel_state.get_context_parallel_group())
    return get_batch_on_this_cp_rank(batch)


def build_gpt(args, model_provider, gpt_builders):
    """The GPT model as this Megatron-LM's pretrain_gpt.py builds it: from core_v0.19 the
    model config it makes from the arguments (`gpt_config_from_args`) and that config's
    builder (`GPTModelBuilder.build_model`), before it the model_provider with
    gpt_builder."""
    try:
        from megatron.training.argument_utils import gpt_config_from_args
    except ImportError:
        return model_provider.model_provider(gpt_builders.gpt_builder, pre_process=True,
                                             post_process=True)
    from megatron.core.process_groups_config import ProcessGroupCollection
    cfg = gpt_config_from_args(args)
    builder = cfg.get_builder_cls()(cfg)
    return builder.build_model(ProcessGroupCollection.use_mpu_process_groups(),
                               pre_process=True, post_process=True)


def train_real(argv, dhelix, steps=3, delay_gather=False, signal_at=None):
    """Build the model with Megatron-LM's model_provider and gpt_builder (after the
    install hook when `dhelix`), wrap it in megatron DDP, and run `steps` iterations of
    the forward-backward function Megatron-LM's train_step would get from
    megatron.training.training.get_forward_backward_func, with pretrain_gpt's loss.
    Returns, besides what was built: `losses` (per step, each micro-batch's loss over this
    rank's tokens), `loss_sums` (per step, each micro-batch's [loss sum, tokens]),
    `grad_checksums` (per step, `checksums(model, "main_grad")` after the reduction) and
    `weight_checksums` (the final weights). With --use-distributed-optimizer the step is
    Megatron-LM's own optimizer's (instead of a fixed SGD step); `delay_gather` delays
    every overlapped parameter all-gather until it is waited for (optim_fns.DelayedGather).
    `signal_at` (step, micro-batch), 1-based: the loop runs inside Megatron-LM's
    DistributedSignalHandler (what --exit-signal-handler installs), and rank 0 sends
    itself SIGTERM in that micro-batch's forward step, i.e. in the middle of DHelix's
    co-step; `signals` is then each step's `signals_received()` (every rank's flag)."""
    from functools import partial

    args = init_megatron(argv + (["--dhelix"] if dhelix else []))
    import gpt_builders
    import megatron.training.training as training
    import model_provider as mp
    import pretrain_gpt
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.rerun_state_machine import RerunDataIterator, get_rerun_state_machine
    from dhelix.megatron.install import install, uninstall
    from dhelix.strand.layer import DHelixLayer
    uninstall()
    installed = install(args)
    try:
        torch.manual_seed(args.seed)
        model = build_gpt(args, mp, gpt_builders)
        layers = [type(m).__name__ for m in model.modules()
                  if type(m).__name__.endswith("TransformerLayer") or isinstance(m, DHelixLayer)]
        cores = [type(m.self_attention.core_attention).__name__
                 for m in model.decoder.layers]
        state_keys = sorted(k for k in model.state_dict() if not k.endswith("_extra_state"))
        config = model.config
        model = DistributedDataParallel(config=config, ddp_config=DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=args.use_distributed_optimizer,
            overlap_grad_reduce=args.overlap_grad_reduce,
            overlap_param_gather=args.overlap_param_gather), module=model)
        config.no_sync_func = model.no_sync
        config.finalize_model_grads_func = finalize_model_grads
        fb = training.get_forward_backward_func()
        schedule = getattr(getattr(fb, "func", fb), "__name__", str(fb))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)    # grads only; see below
        if args.use_distributed_optimizer:      # Megatron-LM's own optimizer, as it builds it
            from megatron.core.optimizer import get_megatron_optimizer
            from dhelix.compat.cpu import cuda_type_names
            ocfg, overrides = training.get_megatron_optimizer_config(args)
            with cuda_type_names():
                opt = get_megatron_optimizer(ocfg, [model], overrides)
        delayed = contextlib.nullcontext()
        if delay_gather:
            from optim_fns import DelayedGather
            delayed = DelayedGather()

        g = torch.Generator().manual_seed(7)
        nmb = args.global_batch_size // args.micro_batch_size
        losses, sums, grad_sums, signals = [], [], [], []
        handler = contextlib.nullcontext()
        if signal_at is not None:
            from megatron.training.dist_signal_handler import DistributedSignalHandler
            handler = DistributedSignalHandler()
        stack = contextlib.ExitStack()
        watcher = stack.enter_context(handler)
        counter = {"mb": 0}
        for it in range(steps):
            batches = []
            for _ in range(nmb):
                t = torch.randint(0, args.vocab_size, (args.micro_batch_size,
                                                       args.seq_length + 1), generator=g)
                batches.append({"tokens": t[:, :-1], "labels": t[:, 1:],
                                "loss_mask": torch.ones(args.micro_batch_size,
                                                        args.seq_length),
                                "position_ids": torch.arange(args.seq_length).repeat(
                                    args.micro_batch_size, 1)})
            # pretrain_gpt's get_batch: this CP rank's two chunks (megatron-core's function)
            batches = [cp_batch(b) for b in batches]
            it_data = RerunDataIterator(iter(batches))   # as build_train_valid_test_data_iterators

            def forward_step(data_iterator, model):
                b = next(data_iterator)
                counter["mb"] += 1
                if (signal_at is not None and torch.distributed.get_rank() == 0 and
                        (it + 1, counter["mb"]) == tuple(signal_at)):
                    import signal as _signal
                    os.kill(os.getpid(), _signal.SIGTERM)
                out = model(b["tokens"], b["position_ids"], None, labels=b["labels"],
                            loss_mask=b["loss_mask"])
                return out, partial(pretrain_gpt.loss_func, b["loss_mask"], model=model)

            # as Megatron-LM's train_step calls it: inside the rerun state machine's loop
            rerun = get_rerun_state_machine()
            counter["mb"] = 0
            while rerun.should_run_forward_backward(it_data):
                model.zero_grad_buffer()
                opt.zero_grad()
                with delayed:
                    out = fb(forward_step_func=forward_step, data_iterator=it_data,
                             model=[model], num_microbatches=nmb,
                             seq_length=args.seq_length,
                             micro_batch_size=args.micro_batch_size, forward_only=False)
            losses.append([float(o["lm loss"][0] / o["lm loss"][1]) if o["lm loss"].numel() == 2
                           else float(o["lm loss"]) for o in out])
            sums.append([[float(x) for x in o["lm loss"]] for o in out])
            grad_sums.append(checksums(model, "main_grad"))
            if signal_at is not None:       # as Megatron-LM's train loop asks, each step
                signals.append([bool(x) for x in watcher.signals_received()])
            if args.use_distributed_optimizer:
                with cuda_type_names():
                    assert opt.step()[0]
                continue
            # a fixed SGD step on megatron's main grads, so later steps see new weights
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(p.main_grad, alpha=-1e-2)
        weight_sums = checksums(model, "data")
        stack.close()
    finally:
        uninstall()
    del opt
    return {"installed": installed, "layers": layers, "schedule": schedule,
            "losses": losses, "loss_sums": sums, "grad_checksums": grad_sums,
            "weight_checksums": weight_sums,
            "params": len(list(model.parameters())), "core_attention": cores,
            "state_keys": state_keys, "delayed_gathers": getattr(delayed, "delayed", 0),
            "signals": signals}
