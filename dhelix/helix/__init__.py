"""Helix: communication–computation overlap as passes on torch.compile graphs.

A model-parallel program written with PyTorch's own parallel APIs (DTensor tensor
parallel, functional collectives) is captured by `torch.compile`; AOT autograd hands its
forward and backward graphs to `helix_backend`, where every compute op, collective and
`wait_tensor` is a node. The passes:
  tiling.py    split the graph along the batch dimension into K tile streams, proving
               each op safe to split (or refusing it by name)
  reorder.py   segmented round-robin: each stream's ops up to a wait form a segment;
               segments of the streams are issued in turn, so one stream's collective
               runs under another stream's compute
  check.py     every data dependency of the program kept (checked on the graphs)
  simulate.py  the scheduled graph played by DHelix's simulator: makespan, and peak
               memory from tensor lifetimes
  backend.py   the torch.compile backend, and the report of what each pass did
  paced.py     the graph's collectives on the paced link (for measuring here)
  models.py    reference programs (a TP+SP block, a small GPT); bench.py measures them
  bucketing.py the streams' copies of a collective merged back where the simulator says
               it pays, under a memory budget, chosen by a dynamic program
"""
from dhelix.helix.backend import HelixOptions, HelixReport, helix_backend

__all__ = ["HelixOptions", "HelixReport", "helix_backend"]
