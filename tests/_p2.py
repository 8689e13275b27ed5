import sys, time
from dhelix.testing import run_ranks
def body(dh):
    from dhelix.train.trainer import TrainConfig, train
    from dhelix.links.paced import active
    r = train(TrainConfig(config="small16", tensor_model_parallel_size=2, sequence_parallel=True, seq_length=128, micro_batch_size=4, global_batch_size=32, train_iters=3, data="synthetic", quiet=True, dhelix=dh))
    l = active()
    import statistics
    return {"step": round(statistics.median(r["step_times_s"][1:]), 3), "waited": round(l.waited_s, 2), "modelled": round(l.modelled_s, 2), "cpu": round(time.process_time(), 2)}
if __name__ == "__main__":
    for link in sys.argv[1:]:
        for dh in ({}, {"enabled": True, "plan": "paired"}):
            r = run_ranks(body, 2, dh, env={"DHELIX_LINK": link}, timeout=900)
            print(link, dh.get("plan", "megatron"), r[0], flush=True)
