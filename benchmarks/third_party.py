"""sublinear on random-initialised third-party models: Hugging Face transformers, peft, diffusers and timm.

    python benchmarks/third_party.py --out docs/models.md

Every model is built from a small config (2 layers, hidden size 32-64, short inputs, random weights; nothing is
downloaded) and trained for 5 SGD steps (lr 0.05) on CPU, from the same initial weights and the same seeds, in eight
modes, each in its own subprocess with an empty inductor cache (so Dynamo's caches, compile times and the RNG start
fresh):

- ``eager``: plain PyTorch;
- ``dynamo-eager``: ``torch.compile(model, backend="eager")``, TorchDynamo's graphs run by eager kernels;
- ``sublinear-eager``: ``sublinear.apply(model, SublinearMemoryConfig(compiler="eager", cache_dir=""))``;
- ``torch.compile``: ``torch.compile(model)`` (inductor);
- ``sublinear-inductor``: ``sublinear.apply(model, SublinearMemoryConfig(compiler="inductor", cache_dir=""))``;
- ``sublinear-eager-budget``, ``sublinear-inductor-budget``: the same with a ``memory_budget`` halfway from the
  lowest predicted peak of any plan to eager's (read off copies of the model planned ahead on the first batch; for a
  model that cannot be planned ahead, from the default plan's predicted peak, planned by three training calls of a
  copy);
- ``sublinear-inductor-meta-inputs``: ``sublinear.compile(model, ...)`` planned ahead on meta tensors shaped as the
  first batch (as the guide shows), then trained on the real batches.

Every inductor mode sets ``torch._inductor.config.fallback_random = True``, so inductor draws its random numbers from
aten's RNG and its dropout masks can be compared. Each run records the loss and every parameter's gradient at every
step, the parameters, buffers and ``torch.get_rng_state()`` at the end, the wall time of every step (zero_grad,
forward, loss, backward and ``optimizer.step()``), and for the sublinear modes the plan (``model.sublinear_plan``).
The report compares sublinear-eager with eager (bit for bit: "exact" means every loss, gradient, parameter and
buffer is equal and the RNG state is the same), and where they differ, with dynamo-eager (a difference TorchDynamo's
capture makes by itself); sublinear-inductor with torch.compile and with eager; the budget modes with eager and
torch.compile, and the meta-inputs mode with torch.compile.

``--modes`` runs a subset of the modes, ``--models`` a subset of the models. Each subprocess uses one thread.
``python benchmarks/third_party.py --one MODEL MODE FILE`` runs one mode of one model and saves its record (a dict
for ``torch.load``); it also takes ``torch.compile-no-layout``, ``torch.compile`` with inductor's
``layout_optimization`` off (its channels-last conversion of convolutions on the CPU), which no report includes.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn.functional as F
from torch import nn

MODES = ("eager", "dynamo-eager", "sublinear-eager", "torch.compile", "sublinear-inductor", "sublinear-eager-budget",
         "sublinear-inductor-budget", "sublinear-inductor-meta-inputs")
STEPS = 5
PLANNING_STEPS = 2  # steps 1 and 2 capture, plan and compile (step 2: graphs that TorchDynamo captures again)
LR = 0.05
INIT_SEED = 1234  # torch.manual_seed before building the model: the same initial weights in every mode
LOOP_SEED = 0  # torch.manual_seed before the first step: the same dropout masks in every mode


# ---------------------------------------------------------------------------------------------------------------
# Models. Each builder returns (model, batches, loss_fn): batches is a list of (args, kwargs, extra), one per step,
# made with a private generator; the model is called as model(*args, **kwargs) and loss_fn(output, extra) is the
# loss. Hugging Face models with labels use their own ``.loss``.
# ---------------------------------------------------------------------------------------------------------------

def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(42)


def _ids(g: torch.Generator, batch: int, seq: int, vocab: int = 100) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, seq), generator=g)


def _hf_loss(out, extra):
    return out.loss


def _lm_batches(batch: int = 2, seq: int = 16):
    g = _gen()
    out = []
    for _ in range(STEPS):
        ids = _ids(g, batch, seq)
        out.append(((), {"input_ids": ids, "labels": ids.clone()}, {}))
    return out


def _seq2seq_batches(batch: int = 2, source: int = 12, target: int = 8):
    g = _gen()
    return [((), {"input_ids": _ids(g, batch, source), "labels": _ids(g, batch, target)}, {}) for _ in range(STEPS)]


def _image_batches(batch: int = 4, size: int = 32, classes: int = 10):
    g = _gen()
    return [((torch.randn(batch, 3, size, size, generator=g),), {},
             {"target": torch.randint(0, classes, (batch,), generator=g)}) for _ in range(STEPS)]


def _labelled_image_batches(batch: int = 4, size: int = 32, classes: int = 10):
    """As :func:`_image_batches`, drawn alike, passed as a Hugging Face model's ``pixel_values`` and ``labels``."""
    g = _gen()
    return [((), {"pixel_values": torch.randn(batch, 3, size, size, generator=g),
                  "labels": torch.randint(0, classes, (batch,), generator=g)}, {}) for _ in range(STEPS)]


def _cross_entropy(out, extra):
    return F.cross_entropy(out, extra["target"])


def bert(width: int = 32, batch: int = 2, seq: int = 16):
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=100, hidden_size=width, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=2 * width, max_position_embeddings=max(128, 2 * seq), num_labels=3)
    g = _gen()
    batches = [((), {"input_ids": _ids(g, batch, seq), "attention_mask": torch.ones(batch, seq, dtype=torch.long),
                     "labels": torch.randint(0, 3, (batch,), generator=g)}, {}) for _ in range(STEPS)]
    return BertForSequenceClassification(cfg), batches, _hf_loss


def _gpt2_model(width: int = 32, positions: int = 64):
    from transformers import GPT2Config, GPT2LMHeadModel
    return GPT2LMHeadModel(GPT2Config(vocab_size=100, n_embd=width, n_layer=2, n_head=4, n_positions=positions))


def gpt2(width: int = 32, batch: int = 2, seq: int = 16):
    return _gpt2_model(width, max(64, 2 * seq)), _lm_batches(batch, seq), _hf_loss


def gpt2_checkpointing():
    model = _gpt2_model()
    model.gradient_checkpointing_enable()
    return model, _lm_batches(), _hf_loss


def _llama_model(width: int = 32, positions: int = 64):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=100, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)
    return LlamaForCausalLM(cfg)


def llama(width: int = 32, batch: int = 2, seq: int = 16):
    return _llama_model(width, max(64, 2 * seq)), _lm_batches(batch, seq), _hf_loss


def t5(width: int = 32, batch: int = 2, source: int = 12, target: int = 8):
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=100, d_model=width, d_kv=width // 4, d_ff=2 * width, num_layers=2, num_decoder_layers=2,
                   num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    return T5ForConditionalGeneration(cfg), _seq2seq_batches(batch, source, target), _hf_loss


def vit():
    from transformers import ViTConfig, ViTForImageClassification
    cfg = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                    patch_size=8, num_labels=10, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)
    return ViTForImageClassification(cfg), _labelled_image_batches(), _hf_loss


def vit_mae():
    from transformers import ViTMAEConfig, ViTMAEForPreTraining
    cfg = ViTMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                       patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                       decoder_num_attention_heads=4, decoder_intermediate_size=64, mask_ratio=0.5)
    g = _gen()
    batches = [((), {"pixel_values": torch.randn(4, 3, 32, 32, generator=g)}, {}) for _ in range(STEPS)]
    return ViTMAEForPreTraining(cfg), batches, _hf_loss


def convnextv2(width: int = 16, batch: int = 4, size: int = 32):
    from transformers import ConvNextV2Config, ConvNextV2ForImageClassification
    cfg = ConvNextV2Config(num_stages=2, hidden_sizes=[width, 2 * width], depths=[1, 1], patch_size=4,
                           image_size=size, drop_path_rate=0.1, num_labels=10)
    return ConvNextV2ForImageClassification(cfg), _labelled_image_batches(batch, size), _hf_loss


def swin(width: int = 16, batch: int = 4, size: int = 32):
    from transformers import SwinConfig, SwinForImageClassification
    cfg = SwinConfig(image_size=size, patch_size=4, embed_dim=width, depths=[2, 2], num_heads=[2, 4], window_size=4,
                     mlp_ratio=2.0, drop_path_rate=0.1, num_labels=10)
    return SwinForImageClassification(cfg), _labelled_image_batches(batch, size), _hf_loss


def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(vocab_size=100, num_mel_bins=16, encoder_layers=2, decoder_layers=2, d_model=32,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64,
                        max_source_positions=16, max_target_positions=32, decoder_start_token_id=1, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, suppress_tokens=None, begin_suppress_tokens=None)
    g = _gen()
    batches = [((), {"input_features": torch.randn(2, 16, 32, generator=g), "labels": _ids(g, 2, 8)}, {})
               for _ in range(STEPS)]
    return WhisperForConditionalGeneration(cfg), batches, _hf_loss


def clip():
    from transformers import CLIPConfig, CLIPModel
    cfg = CLIPConfig(text_config=dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=16),
                     vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, image_size=32, patch_size=8),
                     projection_dim=16)
    g = _gen()
    batches = [((), {"input_ids": _ids(g, 4, 10), "pixel_values": torch.randn(4, 3, 32, 32, generator=g),
                     "return_loss": True}, {}) for _ in range(STEPS)]
    return CLIPModel(cfg), batches, _hf_loss


def mixtral(width: int = 32, batch: int = 2, seq: int = 16):
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=100, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        router_jitter_noise=0.1, output_router_logits=True, max_position_embeddings=max(64, 2 * seq))
    return MixtralForCausalLM(cfg), _lm_batches(batch, seq), _hf_loss


def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    cfg = Qwen2MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, output_router_logits=True,
                         max_position_embeddings=64)
    return Qwen2MoeForCausalLM(cfg), _lm_batches(), _hf_loss


def deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    cfg = DeepseekV3Config(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                           num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                           n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                           kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                           max_position_embeddings=64, rope_scaling=None)
    return DeepseekV3ForCausalLM(cfg), _lm_batches(), _hf_loss


def mixtral_eager_experts():
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        router_jitter_noise=0.1, output_router_logits=True, max_position_embeddings=64)
    cfg._experts_implementation = "eager"  # transformers' Python loop over the experts a batch hits
    return MixtralForCausalLM(cfg), _lm_batches(batch=2, seq=32), _hf_loss


def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                       max_position_embeddings=64, sliding_window=8,
                       layer_types=["sliding_attention", "full_attention"], attn_logit_softcapping=50.0,
                       final_logit_softcapping=30.0)
    return Gemma2ForCausalLM(cfg), _lm_batches(), _hf_loss


def gemma3():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    cfg = Gemma3TextConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                           max_position_embeddings=64, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"])
    return Gemma3ForCausalLM(cfg), _lm_batches(), _hf_loss


def qwen2_vl():
    """One 16x16 image per sequence: 4x4 patches of 4x4 pixels (2 frames each, Qwen2-VL's temporal patch), merged
    2x2 into 4 image tokens between the vision start and end tokens; the image tokens are not predicted."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration
    image, video, start, end = 99, 98, 97, 96
    text = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1]})
    vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4, temporal_patch_size=2,
                  spatial_merge_size=2)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=image, video_token_id=video,
                        vision_start_token_id=start, vision_end_token_id=end)
    batch, grid = 2, (1, 4, 4)
    patches = grid[0] * grid[1] * grid[2]
    tokens = patches // 4  # spatial_merge_size 2
    g = _gen()
    batches = []
    for _ in range(STEPS):
        ids = torch.cat([_ids(g, batch, 4, start), torch.full((batch, 1), start), torch.full((batch, tokens), image),
                         torch.full((batch, 1), end), _ids(g, batch, 6, start)], dim=1)
        labels = ids.masked_fill(ids == image, -100)
        batches.append(((), {"input_ids": ids, "labels": labels,
                             "mm_token_type_ids": (ids == image).to(torch.int32),
                             "pixel_values": torch.randn(batch * patches, 3 * 2 * 4 * 4, generator=g),
                             "image_grid_thw": torch.tensor([grid] * batch)}, {}))
    return Qwen2VLForConditionalGeneration(cfg), batches, _hf_loss


def mamba(width: int = 32, state: int = 8, rank: int = 4, batch: int = 2, seq: int = 16):
    from transformers import MambaConfig, MambaForCausalLM
    cfg = MambaConfig(vocab_size=100, hidden_size=width, state_size=state, num_hidden_layers=2, expand=2,
                      conv_kernel=4, time_step_rank=rank, use_mambapy=False)
    return MambaForCausalLM(cfg), _lm_batches(batch, seq), _hf_loss


def mamba2():
    from transformers import Mamba2Config, Mamba2ForCausalLM
    cfg = Mamba2Config(vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, num_heads=4,
                       head_dim=16, n_groups=1, chunk_size=8, conv_kernel=4)
    return Mamba2ForCausalLM(cfg), _lm_batches(), _hf_loss


def jamba():
    from transformers import JambaConfig, JambaForCausalLM
    cfg = JambaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, expert_layer_period=2,
                      expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=8,
                      mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, use_mamba_kernels=False,
                      output_router_logits=True, max_position_embeddings=64)
    return JambaForCausalLM(cfg), _lm_batches(), _hf_loss


def falcon_mamba():
    from transformers import FalconMambaConfig, FalconMambaForCausalLM
    cfg = FalconMambaConfig(vocab_size=100, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                            conv_kernel=4, time_step_rank=4, use_mambapy=False)
    return FalconMambaForCausalLM(cfg), _lm_batches(), _hf_loss


def recurrent_gemma():
    from transformers import RecurrentGemmaConfig, RecurrentGemmaForCausalLM
    cfg = RecurrentGemmaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=1, lru_width=32, attention_window_size=16,
                               conv1d_width=4, block_types=["recurrent", "attention"], head_dim=8,
                               partial_rotary_factor=0.5)
    return RecurrentGemmaForCausalLM(cfg), _lm_batches(), _hf_loss


def bart():
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2, dropout=0.1,
                     attention_dropout=0.1, activation_dropout=0.1)
    return BartForConditionalGeneration(cfg), _seq2seq_batches(), _hf_loss


def llama_lora(width: int = 32, batch: int = 2, seq: int = 16):
    import peft
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=["q_proj", "v_proj"],
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(_llama_model(width, max(64, 2 * seq)), lora)
    return model, _lm_batches(batch, seq), _hf_loss


def unet(batch: int = 2, size: int = 16):
    from diffusers import UNet2DConditionModel
    model = UNet2DConditionModel(sample_size=size, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                                 cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    g = _gen()
    batches = []
    for _ in range(STEPS):
        sample = torch.randn(batch, 4, size, size, generator=g)
        batches.append(((sample, torch.tensor([10, 500, 20, 900][:batch])),
                        {"encoder_hidden_states": torch.randn(batch, 8, 32, generator=g)},
                        {"target": torch.randn(batch, 4, size, size, generator=g)}))
    return model, batches, lambda out, extra: F.mse_loss(out.sample, extra["target"])


def autoencoder_kl(batch: int = 2, size: int = 16):
    from diffusers import AutoencoderKL
    model = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64),
                          down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                          latent_channels=4, norm_num_groups=8, sample_size=size)
    g = _gen()
    batches = []
    for _ in range(STEPS):
        x = torch.randn(batch, 3, size, size, generator=g)
        batches.append(((x,), {"sample_posterior": True}, {"target": x}))
    return model, batches, lambda out, extra: F.mse_loss(out.sample, extra["target"])


def _import_timm():
    """``import timm``. timm imports torchvision at import time; torchvision is not installed here (timm was
    installed with --no-deps), so if and only if ``import timm`` fails for lack of torchvision, a stand-in for
    torchvision is inserted first: a module finder that answers every ``torchvision.*`` import with a module whose
    attributes are dummy classes (raising if ever instantiated), except the two names timm uses at import time,
    ``InterpolationMode`` and ``FrozenBatchNorm2d``. The models below use neither torchvision code path."""
    try:
        import timm
        return timm
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] != "torchvision":
            raise
    import enum
    import importlib.abc
    import importlib.machinery
    import types

    class Dummy:
        def __init__(self, *args, **kwargs):
            raise RuntimeError("torchvision is not installed (stand-in module)")

    class InterpolationMode(enum.Enum):
        NEAREST = "nearest"
        BILINEAR = "bilinear"
        BICUBIC = "bicubic"
        BOX = "box"
        HAMMING = "hamming"
        LANCZOS = "lanczos"

    class FrozenBatchNorm2d(nn.Module):
        def __init__(self, num_features, eps=1e-5):
            super().__init__()
            self.eps = eps
            for name, init in (("weight", torch.ones), ("bias", torch.zeros), ("running_mean", torch.zeros),
                               ("running_var", torch.ones)):
                self.register_buffer(name, init(num_features))

    names = {"InterpolationMode": InterpolationMode, "FrozenBatchNorm2d": FrozenBatchNorm2d}

    class StubModule(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return names.get(name, Dummy)

    class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path, target=None):
            if fullname == "torchvision" or fullname.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = StubModule(spec.name)
            module.__path__ = []
            module.__version__ = "0.0.0"
            return module

        def exec_module(self, module):
            pass

    for name in [n for n in sys.modules if n == "timm" or n.startswith("timm.")]:
        del sys.modules[name]  # the failed import may have left half-initialised timm modules
    sys.meta_path.insert(0, StubFinder())
    import timm
    return timm


def timm_vit(width: int = 64, batch: int = 4, size: int = 32):
    timm = _import_timm()
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=size, patch_size=8, embed_dim=width,
                              depth=2, num_heads=4, num_classes=10, drop_rate=0.1, drop_path_rate=0.1)
    return model, _image_batches(batch, size), _cross_entropy


def timm_convnext(width: int = 16, batch: int = 4, size: int = 32):
    timm = _import_timm()
    model = timm.create_model("convnext_atto", pretrained=False, depths=(1, 1, 1, 1),
                              dims=(width, 2 * width, 3 * width, 4 * width), num_classes=10, drop_path_rate=0.1)
    return model, _image_batches(batch, size), _cross_entropy


def timm_resnet(batch: int = 4, size: int = 32):
    _import_timm()
    from timm.models.resnet import BasicBlock, ResNet
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10), _image_batches(batch, size), _cross_entropy


class _ScaleSquare(torch.autograd.Function):
    """x * s + 0.1 x², with a hand-written backward."""

    @staticmethod
    def forward(ctx, x, s):
        ctx.save_for_backward(x)
        ctx.s = s
        return x * s + x.pow(2) * 0.1

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * (ctx.s + 0.2 * x), None


class CustomModel(nn.Module):
    """A custom autograd.Function, a Python counter incremented in forward, and a dropout."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 64)
        self.b = nn.Linear(64, 64)
        self.c = nn.Linear(64, 10)
        self.drop = nn.Dropout(0.1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = _ScaleSquare.apply(torch.tanh(self.a(x)), 1.5)
        return self.c(self.drop(F.gelu(self.b(h))))


def custom(rows: int = 8):
    g = _gen()
    batches = [((torch.randn(rows, 32, generator=g),), {}, {"target": torch.randint(0, 10, (rows,), generator=g)})
               for _ in range(STEPS)]
    return CustomModel(), batches, _cross_entropy


# name: (label, library, builder)
MODELS = {
    "bert": ("BERT (BertForSequenceClassification)", "transformers", bert),
    "gpt2": ("GPT-2 (GPT2LMHeadModel)", "transformers", gpt2),
    "gpt2_checkpointing": ("GPT-2, `gradient_checkpointing_enable()`", "transformers", gpt2_checkpointing),
    "llama": ("Llama (LlamaForCausalLM)", "transformers", llama),
    "t5": ("T5 (T5ForConditionalGeneration)", "transformers", t5),
    "vit": ("ViT (ViTForImageClassification)", "transformers", vit),
    "vit_mae": ("ViT-MAE (ViTMAEForPreTraining, mask ratio 0.5)", "transformers", vit_mae),
    "convnextv2": ("ConvNeXt V2 (drop_path 0.1)", "transformers", convnextv2),
    "swin": ("Swin (shifted windows, drop_path 0.1)", "transformers", swin),
    "whisper": ("Whisper (WhisperForConditionalGeneration)", "transformers", whisper),
    "clip": ("CLIP (CLIPModel, return_loss)", "transformers", clip),
    "mixtral": ("Mixtral (MoE, router jitter 0.1, router logits)", "transformers", mixtral),
    "mixtral_eager_experts": ("Mixtral, eager experts (Python loop over experts)", "transformers",
                              mixtral_eager_experts),
    "qwen2_moe": ("Qwen2-MoE (router logits)", "transformers", qwen2_moe),
    "deepseek_v3": ("DeepSeek-V3 (MLA, MoE)", "transformers", deepseek_v3),
    "mamba": ("Mamba (use_mambapy=False)", "transformers", mamba),
    "mamba2": ("Mamba2", "transformers", mamba2),
    "jamba": ("Jamba (Mamba + attention + MoE)", "transformers", jamba),
    "falcon_mamba": ("FalconMamba (use_mambapy=False)", "transformers", falcon_mamba),
    "recurrent_gemma": ("RecurrentGemma", "transformers", recurrent_gemma),
    "gemma2": ("Gemma 2 (logit soft-capping, sliding window 8 < 16)", "transformers", gemma2),
    "gemma3": ("Gemma 3 (Gemma3ForCausalLM, sliding window 8 < 16)", "transformers", gemma3),
    "qwen2_vl": ("Qwen2-VL (image + text, M-RoPE)", "transformers", qwen2_vl),
    "bart": ("BART (BartForConditionalGeneration)", "transformers", bart),
    "llama_lora": ("LoRA on Llama (r 4, dropout 0.1, q_proj/v_proj)", "peft", llama_lora),
    "unet": ("UNet2DConditionModel", "diffusers", unet),
    "autoencoder_kl": ("AutoencoderKL (sample_posterior)", "diffusers", autoencoder_kl),
    "timm_vit": ("ViT (drop 0.1, drop_path 0.1)", "timm", timm_vit),
    "timm_convnext": ("ConvNeXt (drop_path 0.1)", "timm", timm_convnext),
    "timm_resnet": ("ResNet (BasicBlock, BatchNorm)", "timm", timm_resnet),
    "custom": ("autograd.Function + `self.calls += 1` + dropout", "custom", custom),
}


# ---------------------------------------------------------------------------------------------------------------
# One run (in a subprocess): python benchmarks/third_party.py --one MODEL MODE RESULT_FILE
# ---------------------------------------------------------------------------------------------------------------

def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}"[:300]


def run_one(name: str, mode: str, path: str) -> None:
    torch.set_num_threads(1)
    import logging

    for noisy in ("transformers", "diffusers", "timm", "peft"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    res = {"model": name, "mode": mode, "phase": "build", "error": None, "skipped": None, "losses": [], "grads": [],
           "times": [], "params": {}, "buffers": {}, "rng": None, "plan": None, "graphs": None, "breaks": None,
           "predicted_peak_bytes": None, "baseline_peak_bytes": None, "budget_bytes": None}
    model = None
    try:
        torch.manual_seed(INIT_SEED)
        try:
            model, batches, loss_fn = MODELS[name][2]()
        except ImportError as exc:
            res["skipped"] = _first_line(exc)
            raise
        model.train()
        res["phase"] = "setup"
        run = model
        if mode.startswith("torch.compile") or mode.startswith("sublinear-inductor"):
            import torch._inductor.config as inductor_config
            inductor_config.fallback_random = True
        if mode == "torch.compile-no-layout":  # inductor's channels-last conversion of convolutions turned off
            inductor_config.layout_optimization = False
        if mode.startswith("torch.compile"):
            run = torch.compile(model)
        elif mode == "dynamo-eager":
            run = torch.compile(model, backend="eager")
        elif mode.startswith("sublinear-"):
            run = _sublinear_run(model, mode, batches[0], loss_fn, res)
        elif mode != "eager":
            raise ValueError(f"unknown mode {mode!r}")
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.SGD(params, lr=LR)
        torch.manual_seed(LOOP_SEED)
        for step, (args, kwargs, extra) in enumerate(batches):
            res["phase"] = f"step {step + 1}"
            t0 = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = loss_fn(run(*args, **kwargs), extra)
            loss.backward()
            optimizer.step()
            res["times"].append(time.perf_counter() - t0)
            res["losses"].append(loss.detach().clone())
            res["grads"].append({n: None if p.grad is None else p.grad.detach().clone() for n, p in zip(names, params)})
        res["phase"] = "done"
    except Exception as exc:  # noqa: BLE001 - every failure is recorded in the result, never raised
        res["error"] = _first_line(exc)
        res["traceback"] = traceback.format_exc()
    if model is not None:
        res["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        res["buffers"] = {n: b.detach().clone() for n, b in model.named_buffers()}
        plan = None
        if mode.startswith("sublinear-"):  # apply() sets it on the model, compile() on what it returns
            plan = model.__dict__.get("sublinear_plan") or getattr(run, "sublinear_plan", None)
        if plan is not None:
            res["plan"] = str(plan)
            res["graphs"] = len(plan.graphs)
            res["breaks"] = len(plan.breaks)
            res["predicted_peak_bytes"] = plan.predicted_peak_bytes
            res["baseline_peak_bytes"] = plan.baseline_peak_bytes
    res["rng"] = torch.get_rng_state()
    torch.save(res, path)


def _sublinear_run(model: nn.Module, mode: str, first: tuple, loss_fn, res: dict) -> nn.Module:
    """The model as sublinear runs it in ``mode``: ``sublinear.apply`` with the executor the mode names;
    ``-budget``: with a memory budget halfway from the lowest predicted peak of any plan to eager's (read off copies
    of the model planned ahead on the first batch; where the code between its graphs reads tensor values, so that it
    cannot be planned ahead, from the default plan's peak, made by three training calls of a copy); ``-meta-inputs``:
    ``sublinear.compile`` planned ahead on meta tensors shaped as the first batch, as the guide shows."""
    import copy
    import dataclasses

    import sublinear
    from torch.utils._pytree import tree_map

    config = sublinear.SublinearMemoryConfig(compiler=mode.split("-")[1], cache_dir="")
    args, kwargs, _extra = first
    if mode.endswith("-budget"):
        planned = _planned_copy(model, first, loss_fn, config)
        lowest, eager_peak = planned.predicted_peak_bytes, planned.baseline_peak_bytes
        try:  # planned ahead, a budget no plan meets names the step's lowest predicted peak
            sublinear.compile(copy.deepcopy(model), args, kwargs, config=dataclasses.replace(config, memory_budget=1))
        except sublinear.BudgetError as exc:
            lowest = exc.smallest
        res["budget_bytes"] = int(lowest + 0.5 * max(0, eager_peak - lowest))
        config = dataclasses.replace(config, memory_budget=res["budget_bytes"])
    if mode.endswith("-meta-inputs"):
        meta_args, meta_kwargs = tree_map(lambda v: torch.empty_like(v, device="meta")
                                          if isinstance(v, torch.Tensor) else v, (args, kwargs))
        return sublinear.compile(model, meta_args, meta_kwargs, config=config)
    return sublinear.apply(model, config)


# ---------------------------------------------------------------------------------------------------------------
# Comparison and the report.
# ---------------------------------------------------------------------------------------------------------------

def _max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    if a.shape != b.shape:
        return float("inf")
    if torch.equal(a, b) or a.numel() == 0:
        return 0.0
    return (a.double() - b.double()).abs().max().item()


def compare(r: dict, ref: dict) -> tuple[bool, float, bool]:
    """(bit for bit equal, max abs difference over losses, gradients, parameters and buffers, RNG state equal)."""
    diffs = [0.0]
    if len(r["losses"]) != len(ref["losses"]):
        diffs.append(float("inf"))
    for a, b in zip(r["losses"], ref["losses"]):
        diffs.append(_max_diff(a, b))
    for ga, gb in zip(r["grads"], ref["grads"]):
        diffs += [_max_diff(ga.get(k), gb[k]) for k in gb]
    for key in ("params", "buffers"):
        if set(r[key]) != set(ref[key]):
            diffs.append(float("inf"))
        diffs += [_max_diff(r[key].get(k), v) for k, v in ref[key].items()]
    rng_equal = r["rng"] is not None and ref["rng"] is not None and torch.equal(r["rng"], ref["rng"])
    equal = all(d == 0.0 for d in diffs)
    return equal and rng_equal, max(diffs), rng_equal


def _diff_text(r: dict | None, ref: dict | None, rng: bool = True) -> str:
    if r is None or ref is None:
        return "–"
    for x in (r, ref):
        if x["skipped"]:
            return "skipped"
        if x["error"]:
            return f"{x['mode']} failed"
    exact, diff, rng_equal = compare(r, ref)
    if exact:
        return "exact"
    text = f"Δ {diff:.1e}" if diff > 0 else "Δ 0"
    if rng and not rng_equal:
        text += ", RNG differs"
    return text


def _planned_copy(model: nn.Module, first: tuple, loss_fn, config):
    """The plan of a copy of ``model`` for the first batch: planned ahead, or, where the code between its graphs
    reads tensor values (no data-less plan), planned by training calls of the copy."""
    import copy

    import sublinear

    args, kwargs, extra = first
    planned = sublinear.compile(copy.deepcopy(model), args, kwargs, config=config)
    if planned.sublinear_plan is None:  # three calls: the uses of the outputs learned, the graphs planned together
        for _ in range(3):
            loss_fn(planned(*args, **kwargs), extra).backward()
    return planned.sublinear_plan


def _budget_cell(r: dict | None, ref: dict | None) -> str:
    """The budget a run planned for, whether its plan's predicted peak is above it, and its training against
    ``ref``."""
    from sublinear.core.units import format_bytes

    text = _diff_text(r, ref)
    if r is not None and r["budget_bytes"]:
        over = r["predicted_peak_bytes"] is None or r["predicted_peak_bytes"] > r["budget_bytes"]
        text = f"{format_bytes(r['budget_bytes'])}{' (plan over it)' if over else ''}: {text}"
    return text


def _plan_cell(r: dict | None) -> str:
    if r is None or r["graphs"] is None:
        return "–"
    return f"{r['graphs']} ({r['breaks']})"


def _peak_cell(r: dict | None) -> str:
    if r is None or not r["baseline_peak_bytes"]:
        return "–"
    return f"{r['predicted_peak_bytes'] / r['baseline_peak_bytes']:.2f}×"


def _time_cells(runs: dict, modes: list[str]) -> tuple[str, str]:
    first, later = [], []
    for mode in modes:
        r = runs.get(mode)
        if r is None or r["error"] or len(r["times"]) <= PLANNING_STEPS:
            first.append("–")
            later.append("–")
            continue
        planning = sum(r["times"][:PLANNING_STEPS])
        first.append(f"{planning:.2f}" if planning >= 0.1 else f"{planning:.3f}")
        later.append(f"{statistics.median(r['times'][PLANNING_STEPS:]) * 1e3:.1f}")
    return " / ".join(first), " / ".join(later)


def run_subprocess(name: str, mode: str, folder: str, timeout: float) -> dict:
    path = os.path.join(folder, f"{name}.{mode}.pt")
    log = os.path.join(folder, f"{name}.{mode}.log")
    cmd = [sys.executable, os.path.abspath(__file__), "--one", name, mode, path]
    t0 = time.perf_counter()
    failure = None
    # Each run compiles with an empty inductor cache, so compile times do not depend on the runs before it.
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(folder, f"{name}.{mode}.inductor"))
    with open(log, "w") as out:
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env)
            if proc.returncode != 0:
                failure = f"subprocess exited with status {proc.returncode}"
        except subprocess.TimeoutExpired:
            failure = f"timed out after {timeout:.0f} s"
    wall = time.perf_counter() - t0
    if os.path.exists(path):
        res = torch.load(path, weights_only=False)
    else:
        with open(log) as f:
            tail = [line for line in f.read().strip().splitlines() if line.strip()]
        res = {"model": name, "mode": mode, "phase": "?", "skipped": None, "times": [], "losses": [], "grads": [],
               "params": {}, "buffers": {}, "rng": None, "graphs": None, "breaks": None, "plan": None,
               "error": f"{failure or 'no result'}" + (f"; last output: {tail[-1][:200]}" if tail else "")}
    res["wall"] = wall
    return res


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        run_one(*sys.argv[2:5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write the markdown report here")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds per subprocess")
    parser.add_argument("--jobs", type=int, default=1, help="runs at a time (each uses one thread)")
    parser.add_argument("--report-from", default=None, metavar="FOLDER",
                        help="run nothing: report the runs that finished in FOLDER (the temporary folder of a run "
                             "stopped part-way, copied); the others are listed as not run")
    parser.add_argument("--commit", default=None, help="with --report-from: the commit the runs were made at")
    options = parser.parse_args()
    modes = [m for m in MODES if m in options.modes.split(",")]
    names = [n for n in options.models.split(",") if n]
    for n in names:
        if n not in MODELS:
            parser.error(f"unknown model {n!r}")
    if options.report_from:
        results, total = _finished_runs(options.report_from, names, modes), None
    else:
        results, total = _run_all(names, modes, options.jobs, options.timeout)
    text = _report(results, names, modes, options.jobs, total, options.commit or _commit())
    print(text)
    if options.out:
        with open(options.out, "w") as f:
            f.write(text)


def _run_all(names: list[str], modes: list[str], jobs: int, timeout: float) -> tuple[dict, float]:
    """Every (model, mode) run in its own subprocess, ``jobs`` at a time: results by model and mode, and the wall
    time of it all."""
    started = time.perf_counter()
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="third_party_") as folder:
        def one(key: tuple[str, str]) -> tuple[tuple[str, str], dict]:
            return key, run_subprocess(*key, folder, timeout)

        keys = [(name, mode) for name in names for mode in modes]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for (name, mode), r in pool.map(one, keys):
                results.setdefault(name, {})[mode] = r
                status = r["skipped"] and f"skipped: {r['skipped']}" or r["error"] or "ok"
                times = " ".join(f"{t:.3f}" for t in r["times"])
                print(f"{name:20s} {mode:20s} {r['wall']:6.1f} s  steps {times}  {status}", flush=True)
    return results, time.perf_counter() - started


def _finished_runs(folder: str, names: list[str], modes: list[str]) -> dict:
    """The results a run of this script left in ``folder`` (its ``MODEL.MODE.pt`` files), for the runs that
    finished."""
    results: dict[str, dict[str, dict]] = {}
    for name in names:
        for mode in modes:
            path = os.path.join(folder, f"{name}.{mode}.pt")
            if os.path.exists(path):
                results.setdefault(name, {})[mode] = torch.load(path, weights_only=False)
    return results


def _report(results: dict, names: list[str], modes: list[str], jobs: int, total: float | None, commit: str) -> str:
    import transformers

    command = "python benchmarks/third_party.py " + " ".join(sys.argv[1:])
    timed = [m for m in ("eager", "sublinear-eager", "torch.compile", "sublinear-inductor") if m in modes]
    lines = [
        "# Third-party models", "",
        "Random-initialised models from Hugging Face transformers, peft, diffusers and timm, plus one custom module, "
        f"each built from a small config (2 layers, hidden size 32–64, short inputs; nothing downloaded) and trained "
        f"for {STEPS} SGD steps (lr {LR}) on CPU from the same initial weights and seeds, in its own subprocess per "
        "mode: `eager` (plain PyTorch), `dynamo-eager` (`torch.compile(model, backend=\"eager\")`: TorchDynamo's "
        "graphs run by eager kernels), `sublinear-eager` (`sublinear.apply(model, "
        "SublinearMemoryConfig(compiler=\"eager\", cache_dir=\"\"))`), `torch.compile` (inductor) and "
        "`sublinear-inductor` (`sublinear.apply(model, SublinearMemoryConfig(compiler=\"inductor\", "
        "cache_dir=\"\"))`); the same two with a `memory_budget` halfway from the lowest predicted peak of any plan "
        "to eager's (`-budget`; read off copies of the model planned ahead on the first batch, or, for a model that "
        "cannot be planned ahead, from the default plan's peak, planned by three training calls of a copy), and "
        "`sublinear-inductor-meta-inputs` (`sublinear.compile(model, meta tensors shaped as the first batch)`: "
        "planned ahead as the guide shows, then trained on the real batches); every inductor mode sets "
        "`torch._inductor.config.fallback_random = True`, so their random "
        "numbers come from aten's RNG. \"exact\" means every loss and gradient at every step, every parameter and "
        "buffer after the last step and `torch.get_rng_state()` are bit for bit equal; otherwise Δ is the largest "
        "absolute difference over losses, gradients, parameters and buffers. Graphs (breaks) and the predicted peak "
        "(the plan's predicted peak over eager's, as in the plan's headline) come from `model.sublinear_plan` after "
        "the last step (two values when the sublinear modes differ). Step times include zero_grad, forward, "
        "backward and `optimizer.step()`; steps 1-2 include capture, planning and compilation (step 2 for graphs "
        "TorchDynamo captures again once the first call set model attributes); later steps are the median of steps "
        f"{PLANNING_STEPS + 1}-{STEPS}. A sublinear-eager result that differs from eager is compared with dynamo-eager "
        "too: \"= TorchDynamo\" means it equals TorchDynamo's own eager run bit for bit, so the difference comes "
        "from capture, not from the plan.", "",
        f"Command: `{command}`", "",
        f"{platform.machine()} CPU, {os.cpu_count()} cores, 1 thread per run (`torch.set_num_threads(1)`), "
        f"torch {torch.__version__}, transformers {transformers.__version__}, {_versions()}. "
        f"sublinear at commit {commit}. Modes run: {', '.join(modes)}. {jobs} run(s) at a time"
        f"{' (step times taken with runs overlapping)' if jobs > 1 else ''}. "
        + (f"Total run time {total / 60:.1f} min." if total is not None else
           "Reported from the runs that finished before the run was stopped (`--report-from`)."), "",
        "| model | library | graphs (breaks) | sublinear-eager vs eager | sublinear-inductor vs torch.compile "
        "(vs eager) | with a budget: sublinear-eager vs eager / sublinear-inductor vs torch.compile | "
        "planned ahead on meta inputs: sublinear-inductor vs torch.compile | predicted peak vs eager "
        f"(sublinear-eager / sublinear-inductor) | steps 1-2 s ({' / '.join(timed)}) | later steps ms, median "
        f"({' / '.join(timed)}) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name in names:
        label, library, _ = MODELS[name]
        runs = results.get(name)
        if not runs:
            lines.append(f"| {label} | {library} | not run | | | | | | | |")
            continue
        first = next(iter(runs.values()))
        if first["skipped"]:
            lines.append(f"| {label} | {library} | skipped | | | | | | | |")
            notes.append(f"{label}: skipped, {first['skipped']}")
            continue
        se, si = runs.get("sublinear-eager"), runs.get("sublinear-inductor")
        graphs = _plan_cell(se)
        if si is not None and _plan_cell(si) != graphs:
            graphs = f"{graphs} / {_plan_cell(si)}"
        se_cell = _diff_text(se, runs.get("eager"))
        if se_cell.startswith("Δ") and "dynamo-eager" in runs and _diff_text(se, runs["dynamo-eager"]) == "exact":
            se_cell += " (= TorchDynamo)"
        si_cell = _diff_text(si, runs.get("torch.compile"))
        if si is not None and "eager" in runs:
            si_cell += f" ({_diff_text(si, runs['eager'], rng=False)})"
        budget = (f"{_budget_cell(runs.get('sublinear-eager-budget'), runs.get('eager'))} / "
                  f"{_budget_cell(runs.get('sublinear-inductor-budget'), runs.get('torch.compile'))}")
        meta = _diff_text(runs.get("sublinear-inductor-meta-inputs"), runs.get("torch.compile"))
        peak = f"{_peak_cell(se)} / {_peak_cell(si)}"
        first_s, later_ms = _time_cells(runs, timed)
        lines.append(f"| {label} | {library} | {graphs} | {se_cell} | {si_cell} | {budget} | {meta} | {peak} | "
                     f"{first_s} | {later_ms} |")
        for mode, r in runs.items():
            if r["error"]:
                notes.append(f"{label}, {mode}: failed at {r['phase']}: `{r['error']}`")
        if se is not None and se_cell.startswith("Δ"):
            dynamo = _diff_text(runs.get("dynamo-eager"), runs.get("eager"))
            notes.append(f"{label}: sublinear-eager is not bit for bit equal to eager ({se_cell}); TorchDynamo's "
                         f"eager backend against eager: {dynamo}.")
        if si is not None and si_cell.startswith("Δ"):
            vs_compile = _diff_text(si, runs.get("torch.compile"))
            notes.append(f"{label}: sublinear-inductor is not bit for bit equal to torch.compile ({vs_compile}).")
    lines += ["", "Predicted peak before compiling against the CPU allocator's measured peak, and a budget sweep per "
              "model:",
              "[compiled_memory.md](compiled_memory.md) (`python benchmarks/compiled_memory.py --jobs 2 --out",
              "docs/compiled_memory.md`).", "", "## Notes", ""]
    lines += [f"- {n}" for n in notes] or ["- No run failed and every sublinear-eager run was exact."]
    return "\n".join(lines) + "\n"


def _commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "sublinear"], cwd=root, capture_output=True,
                               text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes in sublinear/" if dirty else "")


def _versions() -> str:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for lib in ("diffusers", "peft", "timm"):
        try:
            out.append(f"{lib} {version(lib)}")
        except PackageNotFoundError:
            out.append(f"{lib} not installed")
    return ", ".join(out)


if __name__ == "__main__":
    main()
