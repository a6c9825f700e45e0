"""The third-party set of ``benchmarks/third_party.py`` at sizes where a step's peak is 5-40 MiB, so that the 2 %
target of the compiled memory model, not its 256 KiB floor, decides whether a prediction is right (the small
configs' whole peak is often under 1 MiB). Same builders' contract: ``(model, batches, loss_fn)``.

    python benchmarks/compiled_memory.py --size large --jobs 2
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import third_party as tp

BATCH, SEQ, WIDTH = 4, 128, 128


def _lm_batches(seq: int = SEQ, batch: int = BATCH, vocab: int = 100):
    g = tp._gen()
    out = []
    for _ in range(tp.STEPS):
        ids = tp._ids(g, batch, seq, vocab)
        out.append(((), {"input_ids": ids, "labels": ids.clone()}, {}))
    return out


def _image_batches():
    return tp._image_batches(batch=8, size=64)


def bert():
    from transformers import BertConfig, BertForSequenceClassification
    cfg = BertConfig(vocab_size=100, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=2 * WIDTH, max_position_embeddings=2 * SEQ, num_labels=3)
    g = tp._gen()
    batches = [((), {"input_ids": tp._ids(g, BATCH, SEQ), "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long),
                     "labels": torch.randint(0, 3, (BATCH,), generator=g)}, {}) for _ in range(tp.STEPS)]
    return BertForSequenceClassification(cfg), batches, tp._hf_loss


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=100, n_embd=WIDTH, n_layer=2, n_head=4, n_positions=2 * SEQ)
    return GPT2LMHeadModel(cfg), _lm_batches(), tp._hf_loss


def _llama_model():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=WIDTH, intermediate_size=2 * WIDTH,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        max_position_embeddings=2 * SEQ))


def llama():
    return _llama_model(), _lm_batches(), tp._hf_loss


def llama_lora():
    import peft
    model = peft.get_peft_model(_llama_model(), peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                                target_modules=["q_proj", "v_proj"],
                                                                task_type="CAUSAL_LM"))
    return model, _lm_batches(), tp._hf_loss


def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=100, d_model=WIDTH, d_kv=32, d_ff=2 * WIDTH, num_layers=2, num_decoder_layers=2,
                   num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    g = tp._gen()
    batches = [((), {"input_ids": tp._ids(g, BATCH, 96), "labels": tp._ids(g, BATCH, 64)}, {})
               for _ in range(tp.STEPS)]
    return T5ForConditionalGeneration(cfg), batches, tp._hf_loss


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    cfg = MixtralConfig(vocab_size=100, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        router_jitter_noise=0.1, output_router_logits=True, max_position_embeddings=2 * SEQ)
    return MixtralForCausalLM(cfg), _lm_batches(), tp._hf_loss


def mamba():
    # Hugging Face's slow path unrolls the scan over the sequence, step by step: 16 tokens keep the graph small
    from transformers import MambaConfig, MambaForCausalLM
    cfg = MambaConfig(vocab_size=100, hidden_size=WIDTH, state_size=16, num_hidden_layers=2, expand=2,
                      conv_kernel=4, time_step_rank=8, use_mambapy=False)
    return MambaForCausalLM(cfg), _lm_batches(seq=16, batch=16), tp._hf_loss


def unet():
    from diffusers import UNet2DConditionModel
    model = UNet2DConditionModel(sample_size=32, in_channels=4, out_channels=4, block_out_channels=(32, 64),
                                 down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                 up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), layers_per_block=1,
                                 cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    g = tp._gen()
    batches = []
    for _ in range(tp.STEPS):
        sample = torch.randn(4, 4, 32, 32, generator=g)
        batches.append(((sample, torch.tensor([10, 500, 20, 900])),
                        {"encoder_hidden_states": torch.randn(4, 8, 32, generator=g)},
                        {"target": torch.randn(4, 4, 32, 32, generator=g)}))
    return model, batches, lambda out, extra: F.mse_loss(out.sample, extra["target"])


def autoencoder_kl():
    from diffusers import AutoencoderKL
    model = AutoencoderKL(in_channels=3, out_channels=3, block_out_channels=(32, 64),
                          down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                          latent_channels=4, norm_num_groups=8, sample_size=32)
    g = tp._gen()
    batches = []
    for _ in range(tp.STEPS):
        x = torch.randn(4, 3, 48, 48, generator=g)
        batches.append(((x,), {"sample_posterior": True}, {"target": x}))
    return model, batches, lambda out, extra: F.mse_loss(out.sample, extra["target"])


def timm_vit():
    timm = tp._import_timm()
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=64, patch_size=8, embed_dim=WIDTH,
                              depth=2, num_heads=4, num_classes=10, drop_rate=0.1, drop_path_rate=0.1)
    return model, _image_batches(), tp._cross_entropy


def timm_convnext():
    timm = tp._import_timm()
    model = timm.create_model("convnext_atto", pretrained=False, depths=(1, 1, 1, 1), dims=(32, 64, 96, 128),
                              num_classes=10, drop_path_rate=0.1)
    return model, _image_batches(), tp._cross_entropy


def timm_resnet():
    tp._import_timm()
    from timm.models.resnet import BasicBlock, ResNet
    return ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10), _image_batches(), tp._cross_entropy


def custom():
    g = tp._gen()
    batches = [((torch.randn(4096, 32, generator=g),), {}, {"target": torch.randint(0, 10, (4096,), generator=g)})
               for _ in range(tp.STEPS)]
    return tp.CustomModel(), batches, tp._cross_entropy


BUILDERS = {"bert": bert, "gpt2": gpt2, "llama": llama, "llama_lora": llama_lora, "t5": t5, "mixtral": mixtral,
            "mamba": mamba, "unet": unet, "autoencoder_kl": autoencoder_kl, "timm_vit": timm_vit,
            "timm_convnext": timm_convnext, "timm_resnet": timm_resnet, "custom": custom}
