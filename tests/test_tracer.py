import pytest
import torch
from torch import nn

import sublinear
from sublinear.tracer import CaptureError, capture
from sublinear.interpret import NodeProgram


class ItemAssignment(nn.Module):
    """symbolic_trace cannot trace this: item assignment through a mask and a loop over x.shape[0]."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x):
        y = self.bn(self.lin(x))
        y[y < 0] = 0
        rows = []
        for i in range(x.shape[0]):
            rows.append(y[i] * (i + 1))
        return torch.stack(rows).sum(-1)


class DataDependent(nn.Module):
    """No path can capture a branch on a tensor's value."""

    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x - 1


def _run(captured, args, kwargs=None):
    program = NodeProgram(captured.graph_module, root=captured.module)
    return captured.outputs(program.run(captured.placeholder_values(args, kwargs)))


def test_symbolic_trace_first_and_shape_generic():
    lin = nn.Linear(4, 3)
    c = capture(lin, (torch.randn(2, 4),))
    assert c.method == "symbolic_trace" and c.shape_generic and c.attempts == []
    x = torch.randn(7, 4)  # another batch size
    assert torch.equal(_run(c, (x,)), lin(x))


def test_falls_back_to_export_for_item_assignment_and_shape_loops():
    torch.manual_seed(0)
    m = ItemAssignment().eval()
    x = torch.randn(5, 6)
    c = capture(m, (x,))
    assert c.method == "export"
    assert c.attempts and c.attempts[0].startswith("symbolic_trace:")
    assert torch.equal(_run(c, (x,)), m(x))


def test_captured_graph_uses_the_modules_own_tensors():
    m = ItemAssignment()
    c = capture(m, (torch.randn(3, 6),))
    program = NodeProgram(c.graph_module, root=m)
    fetched = [program.run_node(i, []) for i, n in enumerate(program.nodes) if n.op == "get_attr"
               and isinstance(program.run_node(i, []), torch.Tensor) and "lifted" not in n.name]
    own = {id(t) for t in [*m.parameters(), *m.buffers()]}
    assert fetched and all(id(t) in own for t in fetched)


def test_every_path_failing_names_each_path():
    with pytest.raises(CaptureError) as info:
        capture(DataDependent(), (torch.randn(3),))
    message = str(info.value)
    for path in ("symbolic_trace:", "export:", "dynamo:"):
        assert path in message


def test_kwargs_non_tensor_arguments_and_meta_inputs():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x, *, scale=1.0, mask=None):
            y = self.lin(x) * scale
            return y if mask is None else y.masked_fill(mask, 0.0)

    m = M()
    meta_x = torch.empty(2, 4, device="meta")
    c = capture(m, (meta_x,), {"scale": 3.0})
    x = torch.randn(2, 4)
    assert torch.equal(_run(c, (x,), {"scale": 3.0}), m(x, scale=3.0))
    with pytest.raises(AssertionError, match="specialized"):
        _run(c, (x,), {"scale": 2.0})


def test_example_inputs_not_matching_forward():
    with pytest.raises(TypeError, match="do not match"):
        capture(nn.Linear(2, 2), (torch.randn(1, 2), torch.randn(1, 2)))


def test_compile_reports_capture_failures():
    with pytest.raises(CaptureError):
        sublinear.compile(DataDependent(), (torch.randn(3),))
