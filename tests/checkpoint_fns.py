"""Rank functions of tests/test_checkpoint.py (megatron's torch_dist checkpoints)."""
import os
import shutil

import torch.distributed as dist

from dhelix.train.trainer import TrainConfig, train

KEEP = ("first_iteration", "losses", "learning_rates", "weight_checksums", "eval_loss",
        "coords")


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


def train_many(runs):
    """`train` for each keyword dict of `runs` in turn, in one launch of the ranks (a
    --load with train_iters at or below the loaded iteration trains nothing and saves
    that iteration again: a conversion to this run's layout). A run whose --load is
    refused gives {"error": the message}."""
    from dhelix.train.checkpoint import CheckpointError
    out = []
    for kw in runs:
        try:
            out.append(_run(**kw))
        except CheckpointError as e:
            out.append({"error": str(e)})
    return out


def killed_while_saving(root, steps, kill_at, **kw):
    """Train `steps` steps saving every 2; rank 1 dies (SIGKILL, with its writer process)
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
                # the rank and megatron's writer process it forked, as a node's death
                # would take them (killed alone, the writer waits on its parent forever)
                import psutil
                for child in psutil.Process().children(recursive=True):
                    child.kill()
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.01)
    if dist.get_rank() == 1:
        threading.Thread(target=watch, daemon=True).start()
    return _run(train_iters=steps, save=root, save_interval=2, **kw)
