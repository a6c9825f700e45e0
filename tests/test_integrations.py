"""Training loops users already have: Hugging Face's Trainer and a LightningModule, with ``sublinear.apply`` on the
model they hold. Each trains bit for bit like the same loop without sublinear, and the model is really planned."""

import copy

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


def _hf_trainer_run(model, tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=4,
                                          learning_rate=0.1, report_to=[], use_cpu=True, seed=0, save_strategy="no",
                                          logging_strategy="no", disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=_examples()).train()
    return _state(model)


def test_hugging_face_trainer_trains_the_applied_model_like_eager(tmp_path):
    model = _tiny_bert()
    planned = sublinear.apply(copy.deepcopy(model), config=PLAIN)
    eager = _hf_trainer_run(model, tmp_path / "eager")
    ours = _hf_trainer_run(planned, tmp_path / "planned")
    _assert_same(eager, ours)
    plan = planned.forward.sublinear_plan
    assert plan is not None and plan.num_blocks > len(plan.graphs)  # the Trainer's calls ran the plan
    assert type(planned) is transformers.BertForSequenceClassification  # the Trainer holds the same object


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
