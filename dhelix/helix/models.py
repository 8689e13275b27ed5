"""Reference programs for Helix: a transformer block and a small GPT, parallelized with
PyTorch's own tensor-parallel API (DTensor): column/row-parallel linears, sequence-parallel
norms, a vocabulary-parallel embedding. Tests and `dhelix helix-bench` use them."""
import torch
import torch.distributed as dist
import torch.nn.functional as F


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal attention and a GeLU MLP, [b, s, h]."""

    def __init__(self, h=32, heads=4):
        super().__init__()
        self.heads, self.hd = heads, h // heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
        self.qkv, self.proj = torch.nn.Linear(h, 3 * h), torch.nn.Linear(h, h)
        self.fc1, self.fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)

    def attention(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)           # local heads under TP
        q, k, v = (t.reshape(b, s, -1, self.hd).transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) * self.hd ** -0.5
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        return self.proj((p @ v).transpose(1, 2).reshape(b, s, -1))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GPT(torch.nn.Module):
    def __init__(self, vocab=64, h=32, layers=2, heads=4):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, h)
        self.blocks = torch.nn.ModuleList(Block(h, heads) for _ in range(layers))
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


def build(kind, hidden=32, heads=4, vocab=64, layers=2):
    """The model, TP+SP over the world (sequence sharded between blocks)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    if kind == "block":
        return parallelize_module(Block(hidden, heads), mesh, _tp_block_plan()), mesh
    m = GPT(vocab, hidden, layers, heads)
    plan = {"emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    for i in range(len(m.blocks)):
        plan.update(_tp_block_plan(f"blocks.{i}."))
    return parallelize_module(m, mesh, plan), mesh
