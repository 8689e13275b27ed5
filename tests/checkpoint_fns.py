"""Rank functions of tests/test_checkpoint.py (megatron's torch_dist checkpoints)."""
import os
import shutil

import torch.distributed as dist

from dhelix.train.trainer import TrainConfig, train

KEEP = ("losses", "learning_rates", "weight_checksums", "eval_loss", "coords")


def _run(**kw):
    kw.setdefault("quiet", True)
    r = train(TrainConfig(checksums=True, **kw))
    return {k: r.get(k) for k in KEEP}


def interrupted_and_resumed(scratch, cases, steps=4, every=2):
    """For each (name, kw) of `cases`, in one launch of the ranks: a straight run of
    `steps` steps that saves every `every` (`straight`), then a run resumed from its first
    save alone, as a run killed after that save would leave it (`resumed`): the save's
    folder copied under a new root whose tracker names it."""
    out = {}
    for name, kw in cases:
        root = os.path.join(scratch, name)
        straight = _run(train_iters=steps, save=root, save_interval=every, **kw)
        cut = os.path.join(scratch, name + "-cut")
        if dist.get_rank() == 0:
            shutil.copytree(os.path.join(root, f"iter_{every:07d}"),
                            os.path.join(cut, f"iter_{every:07d}"))
            with open(os.path.join(cut, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write(str(every))
        dist.barrier()
        resumed = _run(train_iters=steps, load=cut, **kw)
        out[name] = {"straight": straight, "resumed": resumed}
    return out


def resave(runs):
    """Each keyword dict of `runs` in turn (one launch): load and save again, nothing
    trained (`train_iters` 0: the save is of the loaded iteration)."""
    return [_run(train_iters=0, **kw) for kw in runs]


def killed_while_saving(root, steps, kill_at, **kw):
    """Train `steps` steps saving every 2; rank 1 dies (SIGKILL, as the OOM killer would)
    in the middle of saving iteration `kill_at`: once its own shard file is on disk, before
    the save's metadata is."""
    import signal
    import threading
    import time
    staging = os.path.join(root, f"iter_{kill_at:07d}.saving")

    def watch():
        while True:
            if os.path.isdir(staging) and any(f.startswith("__1_")
                                              for f in os.listdir(staging)):
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)
    if dist.get_rank() == 1:
        threading.Thread(target=watch, daemon=True).start()
    return _run(train_iters=steps, save=root, save_interval=2, **kw)
