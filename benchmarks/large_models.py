"""The third-party set of ``benchmarks/third_party.py`` at sizes where a step's peak is 5-90 MiB, so that the 2 %
target of the compiled memory model, not its 256 KiB floor, decides whether a prediction is right (the small
configs' whole peak is often under 1 MiB): width 128, 4x128 tokens, 64x64 images. The same builders, other sizes.

    python benchmarks/compiled_memory.py --size large --jobs 2
"""

from __future__ import annotations

from functools import partial

import third_party as tp

_TEXT = {"width": 128, "batch": 4, "seq": 128}
_IMAGES = {"batch": 8, "size": 64}

BUILDERS = {
    "bert": partial(tp.bert, **_TEXT), "gpt2": partial(tp.gpt2, **_TEXT), "llama": partial(tp.llama, **_TEXT),
    "llama_lora": partial(tp.llama_lora, **_TEXT), "mixtral": partial(tp.mixtral, **_TEXT),
    "t5": partial(tp.t5, width=128, batch=4, source=96, target=64),
    # Hugging Face's slow path unrolls the scan step by step: 16 tokens keep the graph small
    "mamba": partial(tp.mamba, width=128, state=16, rank=8, batch=16, seq=16),
    "unet": partial(tp.unet, batch=4, size=32), "autoencoder_kl": partial(tp.autoencoder_kl, batch=4, size=48),
    "timm_vit": partial(tp.timm_vit, width=128, **_IMAGES),
    "timm_convnext": partial(tp.timm_convnext, width=32, **_IMAGES),
    "timm_resnet": partial(tp.timm_resnet, **_IMAGES), "custom": partial(tp.custom, rows=4096),
    "convnextv2": partial(tp.convnextv2, width=32, **_IMAGES), "swin": partial(tp.swin, width=32, **_IMAGES),
}
