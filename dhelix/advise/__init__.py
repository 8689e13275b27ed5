"""`dhelix advise`: the layout, the plan and the command for a model on a cluster, predicted
before the cluster is rented.

    layouts.py   the legal layouts (TP, CP, PP and its schedule, DP, EP, micro-batches,
                 recomputation), megatron's rules as plain data
    price.py     one layout's step time, tokens/s, MFU and memory per GPU, from the
                 planner and the simulators (layer shapes planned once)
    report.py    the table, the picture, the commands and the sbatch file
    run.py       the search: enumerate, price, drop what does not fit, rank
"""
