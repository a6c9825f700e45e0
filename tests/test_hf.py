"""Hugging Face transformers models, random-initialised from configs (nothing is downloaded): sublinear trains them
bit for bit like eager and predicts their step's peak memory, including steps TorchDynamo splits into graphs."""

import copy
import dataclasses
import logging
import random

import pytest
import torch

import sublinear
import sublinear.runtime.compile_check as compile_check
from sublinear.core import Plan
from sublinear.execute.compiled import CompiledGraph
from sublinear.measurement import measure_cpu_allocator
from sublinear.training import training_step
from sublinear.simulation.timeline import simulate

from conftest import PLAIN, partitions

import transformers

transformers.logging.set_verbosity_error()

VOCAB, SEQ, BATCH = 64, 12, 3


def tiny_model(family: str, attn: str, vocab: int = VOCAB):
    """A two-layer model of ``family`` with dropout on, and the kind of inputs it takes."""
    T = transformers
    if family == "bert":
        config = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, max_position_embeddings=32)
        return T.BertForSequenceClassification._from_config(config, attn_implementation=attn), "classify"
    if family == "gpt2":
        config = T.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=32, bos_token_id=0,
                              eos_token_id=0)
        return T.GPT2LMHeadModel._from_config(config, attn_implementation=attn), "causal"
    if family == "llama":
        config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                               attention_dropout=0.1, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return T.LlamaForCausalLM._from_config(config, attn_implementation=attn), "causal"
    if family == "t5":
        config = T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                            decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
        return T.T5ForConditionalGeneration._from_config(config, attn_implementation=attn), "seq2seq"
    config = T.ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1,
                         num_labels=3)
    return T.ViTForImageClassification._from_config(config, attn_implementation=attn), "image"


def _loss_in_a_graph_of_its_own(model):
    """``model`` with a graph break right before its loss (as a print, an ``.item()`` or a logging call in loss code
    makes one): the loss runs as a second graph, beside everything the first one holds."""
    loss = model.loss_function

    def broken(*args, **kwargs):
        torch._dynamo.graph_break()
        return loss(*args, **kwargs)

    model.loss_function = broken
    return model


def tiny_inputs(kind: str) -> dict:
    """Labels so that the model returns its loss; token inputs come with a padded attention mask."""
    g = torch.Generator().manual_seed(0)
    if kind == "image":
        return dict(pixel_values=torch.randn(BATCH, 3, 16, 16, generator=g),
                    labels=torch.randint(0, 3, (BATCH,), generator=g))
    ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[0, -4:] = 0
    mask[1, -2:] = 0
    labels = {"classify": torch.randint(0, 2, (BATCH,), generator=g), "causal": ids,
              "seq2seq": torch.randint(1, VOCAB, (BATCH, 7), generator=g)}[kind]
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def hf_training(model, inputs: dict, steps: int = 3):
    """SGD on the model's own loss; returns losses, gradients, state_dict and the RNG state afterwards."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        out = model(**inputs)
        out.loss.backward()
        optimizer.step()
        losses.append(out.loss.detach().clone())
    grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    return losses, grads, {k: v.clone() for k, v in model.state_dict().items()}, torch.get_rng_state()


@pytest.mark.parametrize("attn", ["eager", pytest.param("sdpa", marks=pytest.mark.slow)])
@pytest.mark.parametrize("family", ["bert", pytest.param("gpt2", marks=pytest.mark.slow),
                                    pytest.param("llama", marks=pytest.mark.slow),
                                    pytest.param("t5", marks=pytest.mark.slow),
                                    pytest.param("vit", marks=pytest.mark.slow)])
@pytest.mark.slow
def test_trains_bit_for_bit_like_eager(family, attn):
    torch.manual_seed(0)
    model, kind = tiny_model(family, attn)
    model.train()
    inputs = tiny_inputs(kind)
    eager = hf_training(copy.deepcopy(model), inputs)
    compiled = sublinear.compile(copy.deepcopy(model), config=PLAIN)  # planned at the first training call
    planned = hf_training(compiled, inputs)
    assert compiled.sublinear_plan.num_blocks > len(compiled.sublinear_plan.graphs)  # something is recomputed
    for a, b in zip(eager[0], planned[0]):
        assert torch.equal(a, b)
    assert eager[1].keys() == planned[1].keys()
    for k in eager[1]:
        assert torch.equal(eager[1][k], planned[1][k]), k
    for k in eager[2]:
        assert torch.equal(eager[2][k], planned[2][k]), k
    assert torch.equal(eager[3], planned[3])


@pytest.mark.slow
def test_a_step_split_into_graphs_is_predicted_as_one_step(caplog):
    # The loss runs as a second graph beside everything the first one holds. Its vocabulary is 65 times its width,
    # as GPT-2's is, so the loss graph's peak can decide the step's.
    torch.manual_seed(0)
    model, kind = tiny_model("gpt2", "eager", vocab=2048)
    _loss_in_a_graph_of_its_own(model).train()
    inputs = tiny_inputs(kind)
    with caplog.at_level(logging.WARNING, logger="sublinear"):
        compiled = sublinear.compile(model, example_kwargs=inputs, config=PLAIN)
    assert len(compiled.sublinear_plan.graphs) == 2 and len(compiled.sublinear_plan.breaks) == 1
    assert "2 graphs at 1 graph break" in caplog.text
    code, first = next(iter(compiled.sublinear_backend.latest.items()))
    for plan in (first.plan, Plan.no_split(first.profile.num_ops)):
        compiled.use(sublinear.ParetoPoint(plan, 0, 0, 1.0, 1.0, code))
        measured = sublinear.measure(training_step, compiled, **inputs).peak_bytes
        model.zero_grad(set_to_none=True)
        predicted = compiled.sublinear_plan.predicted_peak_bytes
        assert abs(predicted - measured) / measured < 0.01, (plan, predicted, measured)
    alone = max(simulate(dataclasses.replace(v.profile, step_context=None), v.plan).peak_bytes
                for v in compiled.sublinear_backend.latest.values())
    assert alone < 0.9 * measured  # eager graph 0: the loss graph runs beside all it holds, which alone misses


@pytest.mark.slow
def test_a_budget_holds_for_a_step_split_into_graphs():
    # The first graph alone fits the budget at once; the loss graph beside it fits only once the first graph is
    # planned for it, which planning ahead does in a few rounds.
    torch.manual_seed(0)
    model, kind = tiny_model("gpt2", "eager", vocab=2048)
    _loss_in_a_graph_of_its_own(model).train()
    inputs = tiny_inputs(kind)
    eager = sublinear.compile(model, example_kwargs=inputs, config=PLAIN).sublinear_plan.baseline_peak_bytes
    budget = int(0.9 * eager)
    compiled = sublinear.compile(model, example_kwargs=inputs,
                                 config=dataclasses.replace(PLAIN, memory_budget=budget))
    assert len(compiled.sublinear_plan.graphs) == 2 and compiled.sublinear_plan.predicted_peak_bytes <= budget
    measured = sublinear.measure(training_step, compiled, **inputs).peak_bytes
    model.zero_grad(set_to_none=True)
    assert measured <= budget
    with pytest.raises(sublinear.BudgetError) as info:
        sublinear.compile(model, example_kwargs=inputs, config=dataclasses.replace(PLAIN, memory_budget=budget // 2))
    assert budget // 2 < info.value.smallest < budget


def _peak_after_steps(model, config, steps: int, **inputs) -> int:
    """``model`` under sublinear trained ``steps`` steps on its own loss (gradients set to None after each), then
    one more step's peak as the CPU allocator counts it."""
    run = sublinear.apply(model, config)

    def step(m, **batch):
        m(**batch).loss.backward()

    for _ in range(steps):
        step(run, **inputs)
        model.zero_grad(set_to_none=True)
    return measure_cpu_allocator(step, run, **inputs).peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("compiler", ["inductor", "eager"])
def test_logits_a_loss_graph_read_are_let_go_before_backward_and_the_compiled_code_kept(compiler, monkeypatch):
    # The loss runs in a second graph; a loop that reads only the loss lets the logits go before backward. The
    # first call cannot know that (it plans before its backward, and captures the loss graph after the first): the
    # third profiles again for what the second showed, keeps the plan and its compiled code, and predicts the step.
    compiles = []
    real_compile = CompiledGraph._compile
    monkeypatch.setattr(CompiledGraph, "_compile", lambda self, *a: compiles.append(self) or real_compile(self, *a))
    torch._dynamo.reset()  # GPT-2's frames captured fresh (static), whatever GPT-2 ran in this process before
    torch.manual_seed(0)
    model = _loss_in_a_graph_of_its_own(tiny_model("gpt2", "eager", vocab=2048)[0])
    ids = torch.randint(1, 2048, (4, 32), generator=torch.Generator().manual_seed(0))
    config = dataclasses.replace(PLAIN, compiler=compiler, min_memory_per_time=0)
    measured = _peak_after_steps(model.train(), config, 3, input_ids=ids, labels=ids)
    first = next(iter(model.forward.sublinear_backend.latest.values()))
    assert first.uses[0] == "passed"
    assert len(compiles) == (2 if compiler == "inductor" else 0)
    predicted = model.sublinear_plan.predicted_peak_bytes
    assert abs(predicted - measured) <= max(0.02 * measured, 256 * 1024), (predicted, measured)


@pytest.mark.slow
def test_a_llamas_recomputing_plan_is_predicted_before_compiling_as_inductor_runs_it():
    # Each layer reads the same rotary tables: inductor fuses two kernels that read the same values when they are
    # near in the graph, and a kernel of a block recomputed later fused into this block's backward would pull that
    # block's whole recompute up into it (2.2 MiB, 8 %, over the prediction before the fusion rule).
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=8000, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa").train()
    ids = torch.randint(0, 8000, (4, 128), generator=torch.Generator().manual_seed(0))
    config = dataclasses.replace(PLAIN, compiler="inductor", min_memory_per_time=0)
    measured = _peak_after_steps(model, config, 2, input_ids=ids, labels=ids)
    (graph,) = model.sublinear_plan.graphs
    assert graph.num_blocks > 1
    before = graph.predicted_before_compile_bytes
    assert abs(before - measured) <= max(0.02 * measured, 256 * 1024), (before, measured)


@pytest.mark.slow
def test_a_t5s_plan_under_fallback_random_is_predicted_before_compiling_as_inductor_runs_it():
    # With inductor's fallback_random, T5's backward has nodes traced from the loss that run late, among other ops'
    # backward (the ReLUs' gradient selects): counted at the loss's rank, that rank took the memory live where they
    # ran, and the prediction was 16 % over. The model is tiny, so the bound is relative only.
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration._from_config(config).train()
    g = torch.Generator().manual_seed(0)
    inputs = dict(input_ids=torch.randint(2, 100, (2, 12), generator=g),
                  labels=torch.randint(2, 100, (2, 8), generator=g))
    with torch._inductor.config.patch(fallback_random=True):
        measured = _peak_after_steps(model, dataclasses.replace(PLAIN, compiler="inductor", min_memory_per_time=0), 2,
                                     **inputs)
    (graph,) = model.sublinear_plan.graphs
    assert graph.num_blocks > 1
    assert abs(graph.predicted_before_compile_bytes - measured) <= 0.02 * measured, (graph, measured)


@pytest.mark.slow
def test_a_berts_shared_additive_mask_read_by_a_recomputed_layers_scores_is_made_again_as_predicted(monkeypatch):
    """The first layer's attention makes the additive mask from the attention mask, beside its scaled queries; the
    graph's common-subexpression pass shares it with the second layer, and inductor fuses it into both layers' scores
    (no buffer in forward). The scores' sum with the mask is an op apart (the scores' product, a library kernel, lies
    between them). A plan recomputing the first layer and keeping the second re-runs the mask's op anyway (for the
    scaled queries), which makes the mask again for the sum's re-run: forward does not save it, and the analysis does
    not keep it although the second layer reads it in forward. Saved, it cost 1 MiB here (four times the boolean
    mask): 21,073,576 bytes measured against 20,025,000 now, predicted to 4 bytes."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=256)
    model = transformers.BertForSequenceClassification._from_config(config).train()
    g = torch.Generator().manual_seed(0)
    inputs = dict(input_ids=torch.randint(1, VOCAB, (4, 256), generator=g),
                  attention_mask=torch.ones(4, 256, dtype=torch.long), labels=torch.randint(0, 2, (4,), generator=g))
    with torch._inductor.config.patch(fallback_random=True):
        compiled = sublinear.compile(model, example_kwargs=inputs,
                                     config=dataclasses.replace(PLAIN, compiler="inductor"))
        profile = compiled.sublinear_profile
        second = next(op.index for op in profile.ops if op.name.startswith("bert.encoder.layer.1"))
        plan = Plan.of([second], profile.num_ops)
        before = simulate(profile, plan).peak_bytes
        compiled.use(plan)
        made = partitions(monkeypatch)

        def step(m, **batch):
            m(**batch).loss.backward()

        for _call in range(2):  # the first call sets config.problem_type, and the second captures again for it
            step(compiled, **inputs)
            model.zero_grad(set_to_none=True)
        measured = measure_cpu_allocator(step, compiled, **inputs).peak_bytes
    saved = [node.name for _, backward, _ in made for node in backward.graph.find_nodes(op="placeholder")]
    assert "where" not in saved, saved  # the graph's first ``where``: the additive mask
    assert abs(before - measured) <= 0.005 * measured, (before, measured)


def _holders_at_backward(monkeypatch) -> list:
    """Filled as backward first reaches each graph run: per output, None where the caller let it go, else its
    reference count and what refers to it (what kept it alive, for a failure's message); first, the saved-tensor
    hooks in force before the step."""
    import gc
    import sys

    from sublinear.capture.outputs import GraphOutputs

    found = [("saved-tensor hooks", torch._C._autograd._top_saved_tensors_default_hooks(True))]
    arrives = GraphOutputs._backward_arrives

    def noting(self, gradients):
        if not self._at_backward:
            found.append([None if (t := ref()) is None else
                          (sys.getrefcount(t), [repr(r)[:120] for r in gc.get_referrers(t)][:4]) for ref in self._refs])
        return arrives(self, gradients)
    monkeypatch.setattr(GraphOutputs, "_backward_arrives", noting)
    return found


def _full_size(family: str):
    T = transformers
    with torch.device("meta"):
        if family == "bert":
            model = T.BertForSequenceClassification._from_config(T.BertConfig(), attn_implementation="eager")
            ids = torch.empty(2, 512, dtype=torch.long, device="meta")
            return model.train(), dict(input_ids=ids, labels=torch.zeros(2, dtype=torch.long, device="meta"))
        # use_cache=False: a real call on meta tensors cannot start GPT-2's KV cache (planning on meta can)
        model = T.GPT2LMHeadModel._from_config(T.GPT2Config(use_cache=False), attn_implementation="eager")
        ids = torch.empty(1, 1024, dtype=torch.long, device="meta")
        return model.train(), dict(input_ids=ids, labels=ids)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_full_size_prediction_within_one_percent_of_measured(family):
    # A graph TorchDynamo made dynamic in an earlier test would be planned, and predicted, for its size bucket
    torch._dynamo.reset()
    model, inputs = _full_size(family)
    compiled = sublinear.compile(model, example_kwargs=inputs, config=PLAIN)
    assert compiled.sublinear_plan.graphs[0].signature.endswith("@meta")
    code, first = next(iter(compiled.sublinear_backend.latest.items()))
    n = first.profile.num_ops
    rng = random.Random(0)
    plans = {"planned": first.plan, "eager": Plan.no_split(n), "random": Plan.of(rng.sample(range(n), 20), n),
             "nested": Plan.of(range(0, n, 3), n, soft=[p for p in range(0, n, 3) if p % 12])}
    for label, plan in plans.items():
        if label != "planned":
            compiled.use(sublinear.ParetoPoint(plan, 0, 0, 1.0, 1.0, code))
        measured = sublinear.measure(training_step, compiled, **inputs).peak_bytes
        model.zero_grad(set_to_none=True)
        predicted = compiled.sublinear_plan.predicted_peak_bytes
        assert abs(predicted - measured) / measured < 0.01, (family, label, predicted, measured)


def dynamic_padding():
    """A two-layer BERT classifier and 20 batches of 4 at 10 sequence lengths from 9 to 64 (dynamic padding)."""
    T = transformers
    config = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    model = T.BertForSequenceClassification._from_config(config, attn_implementation="eager").train()
    lengths = [12, 40, 23, 64, 17, 33, 50, 9, 28, 45]
    order = lengths + [lengths[k] for k in (3, 7, 1, 5, 0, 8, 2, 6, 4, 9)]
    g = torch.Generator().manual_seed(0)
    batches = [dict(input_ids=torch.randint(1, VOCAB, (4, n), generator=g),
                    labels=torch.randint(0, 2, (4,), generator=g)) for n in order]
    return model, batches


def sgd_steps(model, batches, loss_of) -> None:
    """One SGD step per batch."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in batches:
        loss_of(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.slow
def test_twenty_steps_over_ten_lengths_plan_twice_and_new_lengths_capture_and_compile_nothing(caplog, monkeypatch):
    """Dynamic padding: a BERT classifier over ten sequence lengths, compiled by inductor. The first call's static
    graph and the dynamic graph are planned and compiled once each, and the dynamic graph profiled again once its
    first backward showed that the step lets the logits go (a new profile, the same plan and code); in the 17 later
    steps (seven lengths not seen before) TorchDynamo captures no frame and nothing is traced, profiled, planned or
    compiled again."""
    import torch._inductor.compile_fx as inductor
    from torch._dynamo.utils import counters

    import sublinear.runtime.pipeline as runtime

    work = []
    for module, name in ((runtime, "trace_joint"), (runtime, "profile_compiled_step"), (inductor, "compile_fx")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: work.append(_n) or _f(*a, **k))

    base, batches = dynamic_padding()
    planned = sublinear.apply(copy.deepcopy(base), dataclasses.replace(PLAIN, compiler="inductor"))
    with caplog.at_level(logging.INFO, logger="sublinear"):
        sgd_steps(planned, batches[:3], lambda m, batch: m(**batch).loss)
        assert "compile_fx" in work  # the counts below can see a compile
        work.clear()
        frames = sum(counters["frames"].values())
        sgd_steps(planned, batches[3:], lambda m, batch: m(**batch).loss)
    searches = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sublinear: planned graph")]
    assert len(searches) <= 2 and not work, (searches, work)
    assert sum(counters["frames"].values()) == frames  # no frame captured again for a new length


@pytest.mark.slow
@pytest.mark.parametrize("budget", [None, 1_900_000])
def test_a_causal_lm_whose_length_changes_trains_like_eager_on_the_default_executor(budget):
    """A user's first calls: a GPT-2 whose sequence length changes, with the default config on inductor. At the
    second length the graph is dynamic, and its backward reads the tokens' row count as a size query; planning it
    raised IndexError. The losses and gradients are eager's to float rounding (no dropout, so that the RNG streams
    of eager and inductor need not agree)."""
    config = transformers.GPT2Config(vocab_size=500, n_embd=64, n_layer=2, n_head=2, n_positions=128,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(config).train()
    planned = sublinear.apply(copy.deepcopy(eager), sublinear.SublinearMemoryConfig(
        compiler="inductor", memory_budget=budget, cost_model="estimate"))
    for length in (16, 24, 20):
        ids = torch.randint(0, config.vocab_size, (2, length))
        losses = []
        for model in (eager, planned):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
        for (name, a), b in zip(eager.named_parameters(), planned.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    plan = planned.sublinear_plan
    assert "planned for" in str(plan) and plan.num_blocks > len(plan.graphs)  # a dynamic graph's plan recomputes
    assert budget is None or plan.predicted_peak_bytes <= budget


@pytest.mark.slow
def test_hugging_face_gradient_checkpointing_trains_bit_for_bit_like_eager():
    # The model's own checkpoint regions (dropout inside) are inlined: sublinear's plan recomputes them, with the
    # forward's dropout masks.
    torch.manual_seed(0)
    model, kind = tiny_model("bert", "eager")
    model.train()
    model.gradient_checkpointing_enable()
    inputs = tiny_inputs(kind)
    eager = hf_training(copy.deepcopy(model), inputs)
    planned = hf_training(sublinear.compile(copy.deepcopy(model), config=PLAIN), inputs)
    assert all(torch.equal(a, b) for a, b in zip(eager[0], planned[0]))
    assert all(torch.equal(eager[1][k], planned[1][k]) for k in eager[1])
    assert torch.equal(eager[3], planned[3])


def _mixtral_with_eager_experts(steps: int = 5):
    """Mixtral with transformers' eager experts (a Python loop over the experts a call hits, the expert MLPs run
    eagerly between a dozen graphs), and ``steps`` batches of token ids."""
    T = transformers
    config = T.MixtralConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             router_jitter_noise=0.1, output_router_logits=True, max_position_embeddings=64)
    config._experts_implementation = "eager"
    torch.manual_seed(1234)
    model = T.MixtralForCausalLM(config).train()
    g = torch.Generator().manual_seed(42)
    batches = [torch.randint(3, 100, (2, 32), generator=g) for _ in range(steps)]
    torch.manual_seed(0)
    return model, batches


@pytest.mark.slow
def test_a_moe_whose_experts_run_eagerly_is_predicted_with_them_and_a_budget_below_its_floor_refused():
    """The expert MLPs between the graphs hold their saved activations, their weights (no graph reads them) and,
    in backward, their gradients: the step's prediction counts them. Routing changes what they hold every call,
    so the graphs never settle on their own: a budget no plan meets is refused after a few calls, not run over."""
    model, batches = _mixtral_with_eager_experts(steps=3)
    run = sublinear.apply(model, dataclasses.replace(PLAIN, compiler="inductor"))

    def step(m, ids):
        m(input_ids=ids, labels=ids).loss.backward()

    for ids in batches:
        step(run, ids)
        model.zero_grad(set_to_none=True)
    measured = measure_cpu_allocator(step, run, batches[-1]).peak_bytes
    lowest = model.sublinear_plan.predicted_peak_bytes
    assert abs(lowest - measured) <= 0.02 * measured, (lowest, measured)  # 55 % under without the eager code
    model, batches = _mixtral_with_eager_experts(steps=6)
    run = sublinear.apply(model, dataclasses.replace(PLAIN, compiler="inductor", memory_budget=int(0.9 * lowest)))
    with pytest.raises(sublinear.BudgetError) as refused:
        for ids in batches:
            step(run, ids)
    assert refused.value.smallest > 0.9 * lowest


@pytest.mark.slow  # a dozen graphs, some run once per expert a call routes tokens to
def test_a_graph_planned_as_eager_is_never_predicted_above_eager_in_a_routed_moe():
    """Mixtral with transformers' eager experts (a Python loop over the experts a call hits): the expert graphs are
    shape families whose calls hold different amounts beside them; a family is simulated in the widest context its
    calls showed, and eager, for the report, in one at least as wide."""
    model, batches = _mixtral_with_eager_experts()
    run = sublinear.apply(model, PLAIN)
    for ids in batches:
        run(input_ids=ids, labels=ids).loss.backward()
    unplanned = [p for p in model.sublinear_plan.graphs if len(p.blocks) == 1]
    assert unplanned and all(p.predicted_peak_bytes <= p.baseline_peak_bytes for p in unplanned), unplanned


@pytest.mark.slow
def test_a_graph_captured_again_reports_the_peak_predicted_before_any_compile(monkeypatch):
    """The classifier sets ``config.problem_type`` at its first call, so TorchDynamo captures the same graph again
    at the second, which reuses the plan and the profile the first graph's compile check taught: the peak reported
    as predicted before compiling is the untaught profile's for that plan and call, not the taught one (the compiled
    step's own, which a comparison with the measured peak compares with itself). Here every op and rank is taught a
    MiB more than its compiled code held."""
    teach = compile_check.taught
    monkeypatch.setattr(compile_check, "taught", lambda profile, plan, forward, backward: teach(
        profile, plan, {op: held + 2 ** 20 for op, held in forward.items()},
        {rank: held + 2 ** 20 for rank, held in backward.items()}))
    torch.manual_seed(0)
    model, _ = tiny_model("bert", "eager")
    ids, labels = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, 2, (BATCH,))
    run = sublinear.apply(model.train(), dataclasses.replace(PLAIN, compiler="inductor"))
    for _call in range(3):
        run(input_ids=ids, labels=labels).loss.backward()
    backend = run.forward.sublinear_backend
    assert len(backend.graphs) == 2
    (variant,) = backend.latest.values()
    untaught = dataclasses.replace(variant.lesson.profiled.untaught, step_context=variant.profile.step_context)
    (graph,) = run.sublinear_plan.graphs
    assert graph.predicted_before_compile_bytes == simulate(untaught, variant.plan).peak_bytes
    assert graph.predicted_before_compile_bytes + 2 ** 20 <= graph.predicted_peak_bytes


@pytest.mark.slow
def test_compiled_code_kept_for_outputs_the_caller_drops_is_predicted_as_it_runs(monkeypatch):
    """GPT-2 returns its attention's keys and values (its cache), which its backward reads. The first call guesses
    the caller holds them, and the plan's code saves them for backward; the second shows the caller drops them, and
    the plan, still meeting the objective, keeps that code. The variant's plan is that code's: the keys and values
    kept through backward, not re-run as the same plan partitioned afresh for dropped outputs would (7 % under
    the code at width 128)."""
    from sublinear.core.analysis import analyse
    from sublinear.execute.compiled.executor import recompute_tags

    torch._dynamo.reset()  # GPT-2's frames captured fresh (static), whatever GPT-2 ran in this process before
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)).train()
    ids = torch.randint(0, VOCAB, (4, 64))
    run = sublinear.apply(model, dataclasses.replace(PLAIN, compiler="inductor", max_time_ratio=1.35))

    def step(m, input_ids):
        m(input_ids=input_ids, labels=input_ids).loss.backward()

    holders = _holders_at_backward(monkeypatch)
    calls = run.forward.sublinear_backend.calls
    with torch._inductor.config.patch(fallback_random=True):
        for _call in range(2):
            step(run, ids)
            holders.append(("captures so far", calls.captures, "runs followed by one",
                            [r.followed_by_capture for r in calls.previous]))
            model.zero_grad(set_to_none=True)
        measured = measure_cpu_allocator(step, run, ids).peak_bytes
    (variant,) = run.forward.sublinear_backend.latest.values()
    assert variant.uses.count("dropped") == len(variant.uses) - 1, f"{variant.uses}; per call: {holders}"
    (graph,) = run.sublinear_plan.graphs
    assert abs(graph.predicted_before_compile_bytes - measured) <= 0.02 * measured, \
        (graph.predicted_before_compile_bytes, measured)
    code = variant.rewritten
    assert isinstance(code, CompiledGraph) and code.plan != variant.plan  # compiled for the first call's guess
    assert recompute_tags(analyse(variant.profile, variant.plan), code.node_names) == code.partitioner.tags
