"""Generated code: the graph as straight-line code computes what the node-by-node executor computes."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

from sublinear.execute.program import NodeProgram

from conftest import Branchy, ResidualNet


class Odd(nn.Module):
    """Slices, Ellipsis, dtypes, keyword arguments, lists of tensors, methods and a buffer read by attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        y = self.lin(x)[:, 1:5, ...]
        y = torch.cat([y, y * self.scale], dim=-1).to(dtype=torch.float64)
        y = F.pad(y, (1, 2), value=0.25).float().reshape(x.shape[0], -1)
        return y.softmax(dim=1)[..., ::2].sum(), y.new_zeros(2)


def graphs_of(module, args, kwargs) -> list:
    """(graph module, real example inputs) of each graph TorchDynamo captures for ``module(*args, **kwargs)``."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(module, backend=backend)(*args, **kwargs)
    return graphs


def test_generated_code_computes_what_the_graph_computes():
    torch.manual_seed(0)
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    cases = [(Odd(), (torch.randn(3, 6, 6),), {}), (ResidualNet().eval(), (torch.randn(2, 3, 16, 16),), {}),
             (Branchy(), (x, y), dict(scale=2.0, bias=torch.randn(16)))]
    for module, args, kwargs in cases:
        for gm, values in graphs_of(module, args, kwargs):
            program = NodeProgram(gm)
            torch.manual_seed(1)  # Branchy's dropout draws the same mask in both runs
            expected = tree_leaves(program.run(list(values)))
            torch.manual_seed(1)
            got = tree_leaves(program.define("run", program.source("run"))(list(values)))
            assert len(got) == len(expected) > 0
            for a, b in zip(expected, got):
                assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, type(module).__name__
