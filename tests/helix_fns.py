"""Helix checks run on every rank: small programs parallelized with PyTorch's own tensor
parallel API (DTensor), compiled with the Helix backend, against eager execution."""
import torch
import torch.distributed as dist
import torch.nn.functional as F


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal attention and a GeLU MLP, [b, s, h]."""

    def __init__(self, h=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def attention(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)           # local heads under TP
        q, k, v = (t.reshape(b, s, -1, 32 // self.heads).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) * (32 // self.heads) ** -0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.proj((p @ v).transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab=64, h=32, layers=2):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, h)
        self.blocks = torch.nn.ModuleList(Block(h) for _ in range(layers))
        self.norm, self.head = torch.nn.LayerNorm(h), torch.nn.Linear(h, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def _tp_block_plan(prefix=""):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel)
    return {f"{prefix}norm1": SequenceParallel(), f"{prefix}norm2": SequenceParallel(),
            f"{prefix}qkv": ColwiseParallel(input_layouts=Shard(1)),
            f"{prefix}proj": RowwiseParallel(output_layouts=Shard(1)),
            f"{prefix}fc1": ColwiseParallel(input_layouts=Shard(1)),
            f"{prefix}fc2": RowwiseParallel(output_layouts=Shard(1))}


def build(kind):
    """The model, TP+SP over the world (sequence sharded between blocks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    if kind == "block":
        return parallelize_module(Block(), mesh, _tp_block_plan()), mesh
    m = GPT()
    plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(m.blocks)):
        plan.update(_tp_block_plan(f"blocks.{i}."))
    return parallelize_module(m, mesh, plan), mesh


def compiled_vs_eager(kind="block", tiles=2, reorder=True, batch=4, seq=8):
    """Max relative difference of the output and of every gradient (input and
    parameters) between eager execution and the Helix-compiled program; plus the
    report."""
    import torch._dynamo
    from torch.distributed.tensor import DTensor

    from dhelix.helix import HelixOptions, helix_backend
    torch._dynamo.reset()
    model, mesh = build(kind)
    g = torch.Generator().manual_seed(1)
    r, w = dist.get_rank(), dist.get_world_size()
    if kind == "block":
        full = torch.randn(batch, seq, 32, generator=g)

        def inp():      # this rank's sequence shard (SP), local: the plans wrap it
            x = full.chunk(w, dim=1)[r].contiguous().requires_grad_()
            return x, x
    else:
        ids = torch.randint(0, 64, (batch, seq), generator=g)

        def inp():
            return None, ids
    gout = None

    def run(m):
        nonlocal gout
        leaf, x = inp()
        y = m(x)
        y = y.to_local() if isinstance(y, DTensor) else y
        if gout is None:
            gout = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
        for p in m.parameters():
            p.grad = None
        y.backward(gout)
        grads = {n: (p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone()
                 for n, p in m.named_parameters()}
        if leaf is not None:
            grads["input"] = leaf.grad.clone()
        return y.detach(), grads

    y0, g0 = run(model)
    backend = helix_backend(HelixOptions(tiles=tiles, reorder=reorder))
    y1, g1 = run(torch.compile(model, backend=backend))
    def rel(a, b):       # max |difference| relative to the largest value
        return ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
    errs = {"output": rel(y0, y1)}
    for n in g0:
        errs[n] = rel(g0[n], g1.get("_orig_mod." + n, g0[n] * float("nan")))
    return {"errors": errs, "report": backend.report.graphs}


def refusal():
    """A program that mixes batch elements (a mean over the batch): tiling must refuse
    it and name the op."""
    import torch._dynamo
    from dhelix.helix import HelixOptions, helix_backend
    from dhelix.helix.tiling import TilingError
    torch._dynamo.reset()
    lin = torch.nn.Linear(8, 8)

    def f(x):
        y = lin(x)
        return y - y.mean(dim=0, keepdim=True)
    c = torch.compile(f, backend=helix_backend(HelixOptions(tiles=2)))
    try:
        c(torch.randn(4, 8, requires_grad=True))
    except Exception as e:          # dynamo wraps backend errors
        cause = e
        while cause is not None and not isinstance(cause, TilingError):
            cause = cause.__cause__ or cause.__context__
        return str(cause) if cause is not None else f"other error: {e!r}"
    return "not refused"
