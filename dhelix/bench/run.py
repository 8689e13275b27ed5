"""`dhelix bench`: the emulated-cluster benchmark (DESIGN §4), all methods in one run.
(The flags are parsed in dhelix/cli/bench.py; the rows and outputs are `report.py`, what
the simulators predict for them `predict.py`.)

For each link (`dhelix.links`: the paced link model, or a tbf-limited namespace) and
model size, the same GPT is trained for the same steps by
  1. megatron-core (baseline),
  2. the intra-batch overlap peer (two half micro-batches, round-robin),
  3. DHelix with the trivial plan (nothing paired: DHelix's own overheads),
  4. DHelix with the planner's plan: the DP over a pairwise table `dhelix profile`
     measured in the same namespace just before (or, with --planner-source analytical,
     over an analytical model of this machine: GEMM rate measured here, the link's rate),
and the table reports tokens/s, speedup over baseline, peak activation memory, the
per-step lower bound max(compute, comm) + the rest, measured from the trivial run's
trace, and the share of the baseline's exposed communication each method hid; for
megatron and the two DHelix rows also the whole step the simulator predicts from the same
profiled table (`planner.whole_step`: the layers, and the embedding, loss, optimizer and
finalize `dhelix profile` measured) and its error against the measured step.

With --pipeline-model-parallel-size G > 1 the methods are the pipeline schedules:
megatron's 1F1B, megatron's interleaved (two chunks per stage, like the fold) and the
DHelix fold with the planner's plan; the table adds per-stage peak memory, the measured
idle share of every stage (1 - its main thread's CPU time / step time) and what the
pipeline simulator predicts for both from the same profiled table.

With --context-parallel-size C > 1 the baseline is megatron's layer with DHelix's ring
attention run op after op (megatron-core's local spec has no CP attention) and the
planned rows add what the simulator predicted for the layer (trivial plan / plan) from
the same table the run planned with.

With --compute paced:CLUSTER --emulate MODEL (one paced link) the ranks keep an emulated
cluster's time, and each row is the measured emulated step beside the simulators'
prediction for the same layout and schedule (`emulated.py`).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Dict, List

from dhelix.bench import emulated, predict, report
from dhelix.bench.report import CHUNKS, EP_METHODS, KEEP, LAST, METHODS, PP_METHODS
from dhelix.links import parse_link



@dataclass
class BenchOptions:
    configs: str = "small16"                  # comma-separated model configs
    links: str = "none,paced:2gbit,paced:1gbit,2gbit"
    nproc: int = 2
    tensor_model_parallel_size: int = 2       # with sequence parallel
    seq_length: int = 128
    micro_batch_size: int = 4
    pipeline_model_parallel_size: int = 1     # > 1: the pipeline schedules
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    num_microbatches: int = 8
    train_iters: int = 6                      # steps per run; the first is not timed
    rounds: int = 1                           # every method this many times, alternating
    planner_source: str = "table"             # "table" (profiled) or "analytical"
    profile_repeats: int = 3
    profile_runs: int = 2                     # profiles in rank processes of their own,
    #                                            merged to each entry's smallest median
    dhelix_mlp_chunks: int = 1                # > 1: the planned runs' MLP in chunks
    dhelix_keep_gathered: object = False      # one more planned run, keeping the gathers
    #                                            (True: both parts, or "attn" / "mlp")
    compute: str = "none"                     # paced:CLUSTER[,x=F]: emulated time
    emulate: str = ""                         # the emulated shape (with compute)
    methods: str = ""                         # comma-separated: run only these methods
    distributed_optimizer: bool = False       # every method as megatron's users run DP:
    #                                            distributed optimizer, overlapped grad
    #                                            reduce and param gather
    out: str = "bench"                        # prefix for .md, .json and .png


def machine_cluster(rate: str, path: str) -> str:
    """A cluster file for this machine: measured fp32 GEMM throughput of one core, and
    the link's rate as the intra-node bandwidth (loopback carries both directions)."""
    import torch
    torch.set_num_threads(1)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    n = 20
    for _ in range(n):
        a @ b
    flops = 2 * 512 ** 3 * n / (time.perf_counter() - t)
    link = parse_link(rate)
    # a tbf loopback carries both directions through one bucket; the paced link models a
    # full-duplex link per rank
    bw = {"none": 5.0, "tbf": link.rate_Bps / 2e9, "paced": link.rate_Bps / 1e9}[link.kind]
    lat = {"none": 60, "tbf": 60, "paced": link.latency_s * 1e6}[link.kind]
    with open(path, "w") as f:
        f.write(f"""name: this-machine-{rate}
peak_flops:
  fp32: {flops:.4e}   # measured: 512x512 fp32 matmul on one core
  bf16: {flops:.4e}
achieved_fraction: 1.0
gpus_per_node: 2
intra_node:
  bandwidth_GBps: {bw:.4f}   # the emulated link ({rate})
  latency_us: {lat:g}
inter_node:
  bandwidth_GBps: {bw:.4f}
  latency_us: {lat:g}
comm_compute_slowdown: 0.1
""")
    return path


def _split_links(text: str) -> List[str]:
    """Split the --links list at its commas, keeping a paced link's options with it: a
    paced link is paced:RATE[,LATENCY][,slow=X] (X: the contention option, how much the
    link's transfers slow the compute beside them), so a latency right after a paced rate
    and a name=value option after a paced link belong to that link:

        'none,paced:2gbit,20us,1gbit'  -> ['none', 'paced:2gbit,20us', '1gbit']
        'paced:1gbit,paced:2gbit,paced:1gbit,20us,slow=0.15'
            -> ['paced:1gbit', 'paced:2gbit', 'paced:1gbit,20us,slow=0.15']

    (Whether the options are valid is `parse_link`'s to say.)"""
    out: List[str] = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        last = out[-1] if out else ""
        opts = last.split(",")[1:] if last.startswith("paced:") else None
        is_latency = part[:1].isdigit() and \
            part.rstrip("0123456789.").endswith(("us", "ms", "s")) and \
            not part.endswith(("bit", "bps"))
        is_option = "=" in part and part.split("=", 1)[0].isidentifier()
        if opts is not None and is_latency and not opts:         # RATE,LATENCY
            out[-1] += "," + part
        elif opts is not None and is_option and \
                part.split("=", 1)[0] not in {o.split("=", 1)[0] for o in opts}:
            out[-1] += "," + part                                # RATE[,LATENCY],name=X
        else:
            out.append(part)
    return out


def _name(cfg: str) -> str:
    """A config's name for the run's files: a YAML path given as --configs by its stem."""
    return os.path.splitext(os.path.basename(cfg))[0] if cfg.endswith((".yaml", ".yml")) \
        else cfg


def _argv(a, cfg, out_json, method, cluster, trace):
    pp, cp = a.pipeline_model_parallel_size, a.context_parallel_size
    dp = a.nproc // (a.tensor_model_parallel_size * pp * cp)
    argv = ["train", "--config", cfg, "--tensor-model-parallel-size",
            str(a.tensor_model_parallel_size), "--sequence-parallel", "--seq-length",
            str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size),
            "--global-batch-size", str(a.micro_batch_size * a.num_microbatches * dp),
            "--train-iters", str(a.train_iters), "--log-interval", str(a.train_iters),
            "--json", out_json, "--data", "synthetic"]
    if method == "intra-batch":
        argv += ["--dhelix-peer", "intra-batch"]
    elif method == "dhelix-trivial":
        argv += ["--dhelix", "--dhelix-plan", "trivial"] + \
            (["--dhelix-trace", trace] if a.compute == "none" else [])
    elif method in ("dhelix-plan", "dhelix-halves", "dhelix-fold", KEEP, LAST):
        # (paced compute: no cost source, the plan is made for the emulated shape)
        argv += ["--dhelix"] + ([] if not cluster else
                                ["--dhelix-overlap-table", cluster]
                                if cluster.endswith(".json") else ["--dhelix-cluster", cluster])
        if method == "dhelix-halves":
            argv += ["--dhelix-halves"]
        elif method == LAST:
            argv += ["--dhelix-pair-last"]
        elif method == KEEP:
            keep = a.dhelix_keep_gathered     # True: both parts; else the parts named
            argv += ["--dhelix-keep-gathered"] + ([] if keep is True else [keep])
    elif method == CHUNKS:
        argv += ["--dhelix", "--dhelix-overlap-table", cluster,
                 "--dhelix-mlp-chunks", str(a.dhelix_mlp_chunks)]
    if dp > 1 and a.distributed_optimizer:
        argv += ["--use-distributed-optimizer", "--overlap-grad-reduce",
                 "--overlap-param-gather"]
    elif dp > 1 and a.expert_model_parallel_size == 1 and cp == 1:
        # dense DP: megatron's bucketed grad reduce overlapped, in every method
        argv += ["--overlap-grad-reduce"]
    if a.expert_model_parallel_size > 1:
        argv += ["--expert-model-parallel-size", str(a.expert_model_parallel_size),
                 "--expert-tensor-parallel-size", "1"]
    if cp > 1:
        argv += ["--context-parallel-size", str(cp)]
    if a.compute != "none" and trace is not None:
        argv += ["--compute", a.compute, "--emulate", a.emulate]
    if pp > 1:
        # every schedule starts from one PP=1 checkpoint: megatron would initialise each
        # layout's stages from different seeds
        argv += ["--pipeline-model-parallel-size", str(pp), "--load",
                 os.path.join(os.path.dirname(out_json), f"init-{_name(cfg)}")]
        if method == "dhelix-fold":
            argv += ["--dhelix-fold"]
        elif method == "megatron-interleaved":
            from dhelix.models.config import load_model_config
            argv += ["--num-layers-per-virtual-pipeline-stage",
                     str(load_model_config(cfg).num_layers // (2 * pp))]
    return argv


def _node_env(a) -> Dict[str, str]:
    """With dense data parallelism, two emulated nodes or more: each TP group inside a
    node, the DP groups across nodes (their reduction on the inter lane, as on a cluster).
    The layer's own groups stay inside a node, as in the table profiled on them."""
    tp = a.tensor_model_parallel_size
    if a.pipeline_model_parallel_size > 1 or a.context_parallel_size > 1 or \
            a.expert_model_parallel_size > 1 or a.nproc <= tp:
        return {}
    return {"DHELIX_NODE_IDS": ",".join(str(r // tp) for r in range(a.nproc))}


def _check_emulation(a, links):
    """The parsed --compute/--emulate (None without): one paced link (the emulation
    replaces its rates with the cluster's), and a layout that fills --nproc."""
    from dhelix.train.emulate import parse
    emu = parse(a.compute, a.emulate)
    if emu is None:
        return None
    if len(links) != 1 or links[0].kind != "paced":
        raise ValueError(f"--compute {a.compute}: give one paced link (--links "
                         f"paced:1gbit): the emulated cluster's links replace its rate, so "
                         f"other links would repeat the same rows")
    tp, cp, pp = (a.tensor_model_parallel_size, a.context_parallel_size,
                  a.pipeline_model_parallel_size)
    if a.nproc % (tp * cp * pp):
        raise ValueError(f"--nproc {a.nproc} is not a multiple of TP×CP×PP = {tp * cp * pp}")
    return emu


def _emulated_nodes(a, emu) -> Dict[str, str]:
    """The ranks on the emulated cluster's nodes (its gpus_per_node each)."""
    from dhelix.train.emulate import _cluster
    return {"DHELIX_NODE_IDS": ",".join(map(str, emulated.node_ids(a, _cluster(emu.cluster))))}


def _profile_argv(a, cfg, out_table, chunks=1):
    return ["profile", "--config", cfg, "--dhelix-mlp-chunks", str(chunks),
            "--tensor-model-parallel-size",
            str(a.tensor_model_parallel_size), "--sequence-parallel", "--seq-length",
            str(a.seq_length), "--micro-batch-size", str(a.micro_batch_size), "--warmup", "1",
            "--repeats", str(a.profile_repeats), "--out", out_table,
            "--expert-model-parallel-size", str(a.expert_model_parallel_size),
            "--context-parallel-size", str(a.context_parallel_size)]


def _profile(a, cfg, out_table, nproc, chunks, prefix, env, log, what) -> None:
    """`dhelix profile` of the layer into `out_table`, `a.profile_runs` times in rank
    processes of their own, merged to each entry's smallest median (`min_of_runs`:
    some rank processes run the MLP's ops 2-5x slower for a whole profile here)."""
    from dhelix.planner.costs import merge_run_files
    from dhelix.train.dist import log_tail, spawn_local
    runs = max(1, a.profile_runs)
    stem = os.path.splitext(out_table)[0]
    paths = [out_table] if runs == 1 else [f"{stem}.run{k + 1}.json" for k in range(runs)]
    for path in paths:
        rc = spawn_local(nproc, _profile_argv(a, cfg, path, chunks), prefix=prefix,
                         extra_env=env, timeout_s=3600, log=log)
        if rc != 0:
            raise RuntimeError(f"{what}: dhelix profile failed (exit {rc}); see {log}; its "
                               f"last lines:{log_tail(log)}")
    if runs > 1:
        merge_run_files(paths, out_table)


def _trace_totals(path: str) -> Dict[str, float]:
    from dhelix.strand.trace import LANE_TID     # not the link track: a lane's ops only
    with open(path) as f:
        ev = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    comp = sum(e["dur"] for e in ev if e["tid"] == LANE_TID["compute"]) / 1e6
    lanes = (LANE_TID["intra"], LANE_TID["inter"])
    comm = sum(e["dur"] for e in ev if e["tid"] in lanes) / 1e6
    return {"layer_compute_s": comp, "layer_comm_s": comm}


def run_bench(a: BenchOptions) -> int:
    from tqdm import tqdm

    from dhelix.links import LinkError, launch
    from dhelix.links.tbf import NetnsError
    from dhelix.strand.trace import trace_files
    from dhelix.train.dist import log_tail, spawn_local

    try:
        links = [parse_link(l, "--links") for l in _split_links(a.links)]
        emu = _check_emulation(a, links)
    except (LinkError, ValueError) as e:
        print(f"dhelix bench: error: {e}", file=sys.stderr)
        return 2
    if emu and a.configs == BenchOptions.configs:
        a.configs = emulated.DEFAULT_CONFIGS[a.expert_model_parallel_size > 1]
    configs = [c for c in a.configs.split(",") if c]
    work = tempfile.mkdtemp(prefix="dhelix-bench-")
    log = os.path.join(work, "runs.log")
    rows: List[dict] = []
    methods = PP_METHODS if a.pipeline_model_parallel_size > 1 else \
        EP_METHODS if a.expert_model_parallel_size > 1 or a.context_parallel_size > 1 \
        or emu else METHODS
    profile = a.planner_source == "table" and not emu
    chunked = (a.dhelix_mlp_chunks or 1) > 1
    dense = profile and methods == METHODS     # the dense TP+SP layer, from a profiled table
    for flag, on in (("--dhelix-mlp-chunks", chunked),
                     ("--dhelix-keep-gathered", a.dhelix_keep_gathered)):
        if on and not dense:
            print(f"dhelix bench: error: {flag} plans the dense TP+SP layer from a profiled "
                  f"table (PP, CP and EP 1, --planner-source table)", file=sys.stderr)
            return 2
    methods = methods + (CHUNKS,) * chunked + (KEEP,) * bool(a.dhelix_keep_gathered)
    if a.methods:
        # the paired tail runs only when asked for (PP and EP 1)
        offered = methods + (LAST,) * (a.pipeline_model_parallel_size == 1 and
                                       a.expert_model_parallel_size == 1)
        keep = [m.strip() for m in a.methods.split(",") if m.strip()]
        unknown = [m for m in keep if m not in offered]
        if unknown or methods[0] not in keep:
            print(f"dhelix bench: error: --methods {a.methods}: this layout's methods are "
                  f"{', '.join(offered)}, and the first ({methods[0]}, the baseline the "
                  f"others are checked against) must be among them", file=sys.stderr)
            return 2
        methods = tuple(m for m in offered if m in keep)
    per = len(methods) * a.rounds + profile + chunked
    planned = None
    wrong: List[str] = []          # DHelix runs that did not train as the baseline did
    bar = tqdm(total=len(configs) * len(links) * per, desc="dhelix bench", unit="run")
    try:
        for lk in links:
            link = lk.text
            with launch(lk) as (prefix, env):
                for cfg in configs:
                    if a.pipeline_model_parallel_size > 1 and \
                            not os.path.isdir(os.path.join(work, f"init-{_name(cfg)}")):
                        init = _argv(a, cfg, os.path.join(work, "init.json"), "megatron",
                                     "", None)
                        init = init[:init.index("--train-iters")] + [
                            "--train-iters", "0", "--save", os.path.join(work, f"init-{_name(cfg)}")]
                        rc = spawn_local(a.tensor_model_parallel_size, init, prefix=prefix,
                                         extra_env=env, timeout_s=600, log=log)
                        if rc != 0:
                            raise RuntimeError(f"{cfg}: the initial checkpoint failed (exit "
                                               f"{rc}); see {log}; its last lines:"
                                               f"{log_tail(log)}")
                    if emu:        # the cost source is the emulated cluster's file
                        cluster = ""
                    elif profile:
                        cluster = os.path.join(work, f"table-{_name(cfg)}-{link}.json")
                        bar.set_postfix_str(f"{cfg} {link} profile")
                        # the layer's TP (× EP × CP) groups alone: the table is per layer
                        _profile(a, cfg, cluster, a.tensor_model_parallel_size *
                                 a.expert_model_parallel_size * a.context_parallel_size,
                                 1, prefix, env, log, f"{cfg} {link}")
                        bar.update(1)
                        if chunked:     # the chunked run's layer: its MLP in chunks
                            planned = os.path.join(work, f"table-{_name(cfg)}-{link}-chunks.json")
                            bar.set_postfix_str(f"{cfg} {link} profile (MLP chunks)")
                            _profile(a, cfg, planned, a.tensor_model_parallel_size,
                                     a.dhelix_mlp_chunks, prefix, env, log,
                                     f"{cfg} {link} --dhelix-mlp-chunks")
                            bar.update(1)
                    else:
                        cluster = machine_cluster(link, os.path.join(work, f"cl-{link}.yaml"))
                    res = {}
                    env = dict(env, **(_emulated_nodes(a, emu) if emu else _node_env(a)))
                    for rnd in range(a.rounds):
                        for method in methods:
                            out = os.path.join(work, f"{_name(cfg)}-{link}-{method}-{rnd}.json")
                            trace = os.path.join(work, f"{_name(cfg)}-{link}-trace.json")
                            bar.set_postfix_str(f"{cfg} {link} {method} round {rnd + 1}")
                            train_argv = _argv(a, cfg, out, method,
                                               planned if method == CHUNKS else cluster,
                                               trace)
                            rc = spawn_local(a.nproc, train_argv, prefix=prefix,
                                             extra_env=env, timeout_s=1800, log=log)
                            if rc != 0:
                                raise RuntimeError(
                                    f"{cfg} {link} {method}: ranks failed (exit {rc}); see "
                                    f"{log}; the run was: dhelix {' '.join(train_argv)} "
                                    f"--nproc {a.nproc}; the log's last lines:{log_tail(log)}")
                            with open(out) as f:
                                r = json.load(f)
                            bad = report.loss_mismatch(method, r, methods[0],
                                                       res[methods[0]]) if res else ""
                            if bad:
                                wrong.append(f"{cfg} {link} round {rnd + 1}: {bad} ({out})")
                            r["peer_wait_s"] = report.peer_wait_per_step(r)
                            res[method] = report.pool_round(res.get(method), r, rnd)
                            bar.update(1)
                    if emu:
                        rows += emulated.rows(a, cfg, link, res, methods,
                                              emulated.predictions(a, cfg, emu))
                    elif a.pipeline_model_parallel_size > 1:
                        rows += report.pp_rows(a, cfg, link, res, cluster)
                    else:
                        preds = predict.step_predictions(a, cfg, cluster)
                        if planned:           # the chunked run, from its own table
                            preds[CHUNKS] = predict.planned_step(a, cfg, planned)
                        if KEEP in methods:   # the plain layer's table serves it
                            preds[KEEP] = predict.planned_step(a, cfg, cluster,
                                                                 keep=a.dhelix_keep_gathered)
                        # the thread floor of each method's layer and table
                        floor = predict.step_floor(a, cfg, cluster)
                        floors = {m: floor for m in methods}
                        if planned:
                            floors[CHUNKS] = predict.step_floor(a, cfg, planned)
                        if KEEP in methods:
                            floors[KEEP] = predict.step_floor(a, cfg, cluster,
                                                              keep=a.dhelix_keep_gathered)
                        rows += report.rows(cfg, link, res,
                                            _trace_totals(trace_files(trace)[0]), methods,
                                            predict.layer_prediction(a, cfg, cluster), preds,
                                            floors)
    except NetnsError as e:
        print(f"dhelix bench: error: {e}", file=sys.stderr)
        return 2
    finally:
        bar.close()
    md = emulated.markdown(rows) if emu else \
        report.pp_markdown(rows) if a.pipeline_model_parallel_size > 1 else \
        report.markdown(rows)
    print(md)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out + ".md", "w") as f:
        f.write(md + "\n")
    with open(a.out + ".json", "w") as f:
        json.dump({"args": asdict(a), "rows": rows}, f, indent=1)
    if emu:
        emulated.plot(rows, a.out + ".png")
    elif a.pipeline_model_parallel_size > 1:
        report.plot(rows, a.out + ".png", PP_METHODS, "megatron 1F1B")
    else:
        report.plot(rows, a.out + ".png", methods)
    print(f"dhelix bench: wrote {a.out}.md, {a.out}.json, {a.out}.png (runs under {work})")
    if wrong:
        print("dhelix bench: error: these DHelix runs did not train bit for bit as the "
              "baseline on the same seed and data, so their times do not count:\n  " +
              "\n  ".join(wrong), file=sys.stderr)
        return 1
    return 0


