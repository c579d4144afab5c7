"""Build a small random-weight model folder for tests and benchmarks, with no network.

Usage: python examples/make_tiny_model.py OUT_DIR [--preset tiny|small|hybrid-swa|hybrid-ssm|mla|swa|vlm]

Trains a byte-level BPE tokenizer on deterministically generated text, wraps it in a
PreTrainedTokenizerFast with a chat template, builds a model with random weights (bf16, or the
preset's dtype) from a fixed seed and saves both into OUT_DIR. The same preset gives the same files on
every run. The folder is built next to OUT_DIR and renamed into place, so an existing
OUT_DIR is a complete model and the build is skipped.
"""

import argparse
import logging
import os
import random
import shutil
import sys

from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig,
                          Idefics3ForConditionalGeneration,
                          LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3NextConfig, Qwen3NextForCausalLM)

log = logging.getLogger("build_model")

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]  # Idefics3's
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SHAPE = dict(head_dim=64, max_position_embeddings=4096, torch_dtype="bfloat16",
             rms_norm_eps=1e-6, rope_theta=10000.0)
TINY = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=688,
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)


@dataclass(frozen=True)
class Preset:
    config_cls: type
    model_cls: type
    tokenizer_vocab: int
    shape: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.bfloat16
    # An Idefics3 vision tower's shape (Idefics3VisionConfig): the model is then a vision-language
    # model (model_cls) around the text model config_cls describes, saved with its processor.
    vision: dict | None = None


PRESETS = {
    # ~3.4M parameters: fast to build and start, too fast to show timing differences.
    "tiny": Preset(LlamaConfig, LlamaForCausalLM, 3072, TINY),
    # Qwen2-0.5B shape (494M parameters, 151936-entry embedding table).
    "small": Preset(Qwen2Config, Qwen2ForCausalLM, 8192, dict(
        num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
        num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
        vocab_size=151936, rope_theta=1000000.0)),
    # Gemma 3 text: 3 sliding-window layers (256 tokens) and 1 full-attention layer. float32:
    # on random weights bf16 flips greedy tokens between any two compute paths.
    "hybrid-swa": Preset(Gemma3TextConfig, Gemma3ForCausalLM, 3072, dict(
        TINY, query_pre_attn_scalar=64, sliding_window=256, torch_dtype="float32",
        layer_types=["sliding_attention"] * 3 + ["full_attention"]), torch.float32),
    # Qwen3-Next: 3 gated-delta-net (linear attention, SSM-like state) layers and 1 full-attention
    # layer, 4 experts. bf16: vLLM's CPU GDN kernel requires it; linear head dims of 64 (32 fails).
    "hybrid-ssm": Preset(Qwen3NextConfig, Qwen3NextForCausalLM, 3072, dict(
        TINY, linear_key_head_dim=64, linear_value_head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
        shared_expert_intermediate_size=128, layer_types=["linear_attention"] * 3 + ["full_attention"])),
    # DeepSeek-V2: multi-head latent attention (MLA: one latent of kv_lora_rank + qk_rope_head_dim
    # per token and layer, the same on every tensor-parallel rank), 2 layers (1 dense MLP, 1 MoE of
    # 4 routed experts and 1 shared). DeepSeek's own head shapes: vLLM's CPU MLA backend refuses
    # smaller ones ("Head dimension 96 is not supported by MLA"); its CPU MoE router needs n_group
    # and topk_group set. fp32, as hybrid-swa. vLLM's CPU build runs it with block size 16 and its
    # own prefix caching off.
    "mla": Preset(DeepseekV2Config, DeepseekV2ForCausalLM, 3072, dict(
        TINY, num_hidden_layers=2, num_key_value_heads=4, kv_lora_rank=512, q_lora_rank=None,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=128,
        n_group=1, topk_group=1, torch_dtype="float32"), torch.float32),
    # Idefics3 (vision-language): the tiny Llama behind a 2-layer SigLIP-style vision tower, one
    # 64x64 tile per image (64 patches of 4x4 pixels x 4 = 64 <image> tokens after pixel shuffle).
    # Idefics3 because vLLM's CPU build serves it without torchvision (a CUDA build is all PyPI has
    # for this torch): its processor has a PIL image backend, and vLLM's llava, qwen2_vl, gemma3_mm
    # modules import transformers' torchvision image processors. fp32, as hybrid-swa.
    "vlm": Preset(LlamaConfig, Idefics3ForConditionalGeneration, 3072, dict(TINY, torch_dtype="float32"),
                  torch.float32, vision=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=2, image_size=64, patch_size=4)),
    # Mistral with a sliding window of 64 tokens on every layer and no layer_types: vLLM gives it a
    # single KV cache group, a SlidingWindowSpec, and puts its null block before the window on a
    # prefix hit. fp32, as hybrid-swa.
    "swa": Preset(MistralConfig, MistralForCausalLM, 3072, dict(TINY, sliding_window=64, torch_dtype="float32"),
                  torch.float32),
}
REQUIRED_FILES = ("config.json", "tokenizer.json", "model.safetensors")


def corpus(n_lines=20000, seed=1234):
    """Yield deterministic pseudo-English lines with digits and punctuation."""
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "ti", "vo", "pre", "str", "ing",
                 "tion", "er", "an", "the", "qu", "ex", "al", "or", "is"]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 4))) for _ in range(3000)]
    for _ in range(n_lines):
        line = " ".join(rng.choices(words, k=rng.randint(4, 16)))
        line += rng.choice([".", ",", "?", "!", ";", f" {rng.randint(0, 99999)}."])
        yield line.capitalize()


def build_tokenizer(vocab_size, extra_special=()):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + list(extra_special), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def build(out_dir, preset):
    spec = PRESETS[preset]
    tokenizer = build_tokenizer(spec.tokenizer_vocab, IMAGE_TOKENS if spec.vision else ())
    vocab = spec.shape.get("vocab_size") or -(-len(tokenizer) // 128) * 128
    config = spec.config_cls(**{**SHAPE, **spec.shape, "vocab_size": vocab},
                             bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id)
    processor = tokenizer
    if spec.vision is not None:
        config, processor = vision_language(config, tokenizer, spec.vision)
    torch.manual_seed(0)
    model = spec.model_cls(config).to(spec.dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log.info("preset %s: %d parameters, tokenizer vocab %d, model vocab %d",
             preset, n_params, len(tokenizer), vocab)
    tmp_dir = out_dir.rstrip("/") + ".tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    processor.save_pretrained(tmp_dir)
    model.save_pretrained(tmp_dir)
    os.replace(tmp_dir, out_dir)


def vision_language(text, tokenizer, vision):
    """Idefics3 around the text config ``text``: the vision tower ``vision``, a pixel-shuffle
    connector (scale 2) and the processor (PIL image backend, no image splitting: one tile of
    ``image_size`` pixels per image, whatever its size)."""
    from transformers import Idefics3Config, Idefics3Processor, Idefics3VisionConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    scale, side = 2, vision["image_size"]
    config = Idefics3Config(vision_config=Idefics3VisionConfig(**vision), text_config=text, scale_factor=scale,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                            pad_token_id=tokenizer.pad_token_id, torch_dtype=text.dtype)
    images = Idefics3ImageProcessorPil(size={"longest_edge": side}, max_image_size={"longest_edge": side},
                                       do_image_splitting=False)
    seq_len = (side // vision["patch_size"]) ** 2 // scale**2
    return config, Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=seq_len,
                                     chat_template=CHAT_TEMPLATE)


def is_complete(out_dir):
    return all(os.path.isfile(os.path.join(out_dir, f)) for f in REQUIRED_FILES)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if is_complete(args.out_dir):
        log.info("%s already holds a model, skipping the build", args.out_dir)
        return 0
    if os.path.exists(args.out_dir):
        log.error("%s exists but is not a complete model; remove it first", args.out_dir)
        return 1
    build(args.out_dir, args.preset)
    log.info("wrote %s", args.out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
