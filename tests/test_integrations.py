"""Training loops users already have: Hugging Face's Trainer and a LightningModule, with ``sublinear.apply`` on the
model they hold. Each trains bit for bit like the same loop without sublinear, and the model is really planned."""

import copy
import logging

import pytest
import torch
import transformers
from torch import nn

import sublinear

from conftest import PLAIN

transformers.logging.set_verbosity_error()


def _tiny_bert():
    config = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config).train()


def _examples(count=16, seq=12):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1, 64, (seq,), generator=g),
             "attention_mask": torch.ones(seq, dtype=torch.long), "labels": torch.randint(0, 2, (), generator=g)}
            for _ in range(count)]


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _hf_trainer_run(model, tmp_path, **arguments):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          learning_rate=0.1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True, **arguments)
    transformers.Trainer(model=model, args=args, train_dataset=_examples()).train()
    return _state(model)


@pytest.mark.slow
def test_hugging_face_trainer_trains_the_applied_model_like_eager(tmp_path):
    model = _tiny_bert()
    planned = sublinear.apply(copy.deepcopy(model), config=PLAIN)
    eager = _hf_trainer_run(model, tmp_path / "eager")
    ours = _hf_trainer_run(planned, tmp_path / "planned")
    _assert_same(eager, ours)
    plan = planned.forward.sublinear_plan
    assert plan is not None and plan.num_blocks > len(plan.graphs)  # the Trainer's calls ran the plan
    assert type(planned) is transformers.BertForSequenceClassification  # the Trainer holds the same object


@pytest.mark.slow
def test_lightning_module_trains_the_applied_network_like_eager(tmp_path):
    import lightning  # seconds to import: only this test pays for it

    class Classifier(lightning.LightningModule):
        """The LightningModule shape: the network is an attribute, and training_step computes the loss."""

        def __init__(self, net: nn.Module, plan: bool):
            super().__init__()
            self.net = sublinear.apply(net, config=PLAIN) if plan else net

        def training_step(self, batch, _index):
            return self.net(**batch).loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def run(module, folder):
        loader = torch.utils.data.DataLoader(_examples(), batch_size=4)
        trainer = lightning.Trainer(max_steps=3, accelerator="cpu", devices=1, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, default_root_dir=str(folder))
        torch.manual_seed(0)
        trainer.fit(module, loader)
        return _state(module)

    model = _tiny_bert()
    eager = run(Classifier(copy.deepcopy(model), plan=False), tmp_path / "eager")
    planned = Classifier(copy.deepcopy(model), plan=True)
    ours = run(planned, tmp_path / "planned")
    _assert_same(eager, ours)
    plan = planned.net.forward.sublinear_plan
    assert plan is not None and plan.num_blocks > len(plan.graphs)


def test_the_backend_named_sublinear_plans_with_the_options_torch_compile_passes(caplog):
    """``torch.compile(model, backend="sublinear", options=...)``: the name is the package's entry point, the options
    are the config's fields by either name, and the step trains like eager."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    reference = copy.deepcopy(model)
    options = {"memory_budget": None, "max_time_ratio": float("inf"), "cache_dir": "", "cost_model": "estimate",
               "compiler": "eager", "grid_tries": 4}  # grid_tries: the clear name of thresh_nr_try
    x = torch.randn(512, 16)
    with caplog.at_level(logging.INFO, logger="sublinear"):
        torch.compile(model, backend="sublinear", options=options)(x).sum().backward()
    reference(x).sum().backward()
    for ours, theirs in zip(model.parameters(), reference.parameters()):
        assert torch.equal(ours.grad, theirs.grad)
    planned = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sublinear: planned graph")]
    assert planned and "1 blocks" not in planned[0], planned
    torch._dynamo.reset()


@pytest.mark.slow
def test_hugging_face_trainer_trains_a_model_compiled_by_the_backend_name(tmp_path, monkeypatch, caplog):
    """A model compiled as ``torch.compile(model, backend="sublinear")`` trains in the Trainer bit for bit like the
    same Trainer without compiling (the eager executor, chosen by $SUBLINEAR_COMPILER, is exact like eager).
    ``TrainingArguments(torch_compile_backend="sublinear")`` itself is refused by accelerate, which accepts only the
    backends of its own list."""
    monkeypatch.setenv("SUBLINEAR_COMPILER", "eager")
    monkeypatch.setenv("SUBLINEAR_CACHE_DIR", "")
    model = _tiny_bert()
    eager = _hf_trainer_run(copy.deepcopy(model), tmp_path / "eager", remove_unused_columns=False)
    compiled = torch.compile(model, backend="sublinear")
    with caplog.at_level(logging.INFO, logger="sublinear"):
        _hf_trainer_run(compiled, tmp_path / "compiled", remove_unused_columns=False)  # forward(*args, **kwargs)
    _assert_same(eager, _state(model))
    assert any(r.getMessage().startswith("sublinear: planned graph") for r in caplog.records)
    torch._dynamo.reset()
