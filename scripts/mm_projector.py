#!/usr/bin/env python3
"""Writes a random-weight vision projector GGUF (an "mmproj" file) that llama.cpp's mtmd library
loads next to a text model: --type gemma3 (the default) or qwen2vl.

gemma3: a Gemma 3 projector for a Gemma 3 text model: a small SigLIP vision tower (patch
embedding, learned position embedding, --blocks pre-norm transformer blocks with biased attention
and a GELU MLP, post layer norm) followed by Gemma 3's projector (average pooling by --merge on
each side, RMS norm `mm.soft_emb_norm.weight`, projection `mm.input_projection.weight` to the
text model's embedding width).

qwen2vl: a Qwen2-VL projector ("qwen2vl_merger") for a Qwen2-VL text model (make_tiny_llama.py
--arch qwen2vl): two --patch kernels (`v.patch_embd.weight`, `v.patch_embd.weight.1`, the two
time steps of Qwen2-VL's 3D patch embedding: a still image goes through both, a pair of video
frames one each), --blocks pre-norm transformer blocks with biased attention, 2D M-RoPE on the
heads and a quick-GELU MLP, the merger's layer norm (`v.post_ln`), then the merger MLP
(`mm.0`, GELU, `mm.2`) over each 2x2 block of patches to the text model's embedding width.
The text model places an image's tokens on a grid with M-RoPE positions.

The weights are seeded noise: the embeddings it produces mean nothing, but every step of the real
path (load, preprocess, encode, decode as embeddings) runs.

The projection width must equal the text model's input embedding width (mtmd_init_from_file
refuses a mismatch): pass the text model with --model (its `<arch>.embedding_length` is read) or
give --proj-dim.

gemma3: an image becomes ((image_size / patch) / merge)^2 tokens: 64 with the defaults (it is
resized to --image-size square).
qwen2vl: an image keeps its aspect ratio: it becomes round(width / (2 * patch)) *
round(height / (2 * patch)) tokens (the 2x2 merge is fixed), llama.cpp resizing it into 8 to
4096 tokens' worth of pixels (its own limits for Qwen2-VL; the GGUF cannot change them, a caller
can through mtmd_context_params.image_max_tokens). The larger default patch (28, Qwen2-VL's own
is 14) keeps that small: a 640x488 image becomes 11 * 9 = 99 tokens on an 11 x 9 grid (at
--patch 14 it would be 23 * 17 = 391). --image-size is written (llama.cpp requires the key) but
does not size qwen2vl's images.

Usage: mm_projector.py OUT.gguf (--model TEXT_MODEL.gguf | --proj-dim N) [--type gemma3|qwen2vl]
       [--seed S] [--image-size 224] [--patch 14 (gemma3) | 28 (qwen2vl)] [--merge 2]
       [--embd 64] [--heads 4] [--ff 128] [--blocks 2]

Needs gguf-py (llama.cpp's gguf-py/ on PYTHONPATH) and numpy.
"""
import argparse
import sys

import numpy as np
import gguf

# OpenAI CLIP's normalisation, which Qwen2-VL's image processor uses.
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def text_embedding_width(path: str) -> int:
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        sys.exit(f"--model {path}: cannot read it as GGUF ({e})")
    arch_field = reader.get_field("general.architecture")
    if arch_field is None:
        sys.exit(f"--model {path}: no general.architecture key")
    arch = arch_field.contents()
    field = reader.get_field(f"{arch}.embedding_length")
    if field is None:
        sys.exit(f"--model {path}: no {arch}.embedding_length key")
    return int(field.contents())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="the text model GGUF whose embedding width the projection takes")
    src.add_argument("--proj-dim", type=int, help="projection width (the text model's input embedding width)")
    ap.add_argument("--type", choices=["gemma3", "qwen2vl"], default="gemma3",
                    help="projector type")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--patch", type=int, help="patch side in pixels (default 14, qwen2vl 28)")
    ap.add_argument("--merge", type=int, default=2,
                    help="gemma3: pooling kernel per side (Gemma 3's own is 4); qwen2vl: must be 2")
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ff", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=2)
    a = ap.parse_args()
    qwen2vl = a.type == "qwen2vl"
    if a.patch is None:
        a.patch = 28 if qwen2vl else 14

    proj_dim = text_embedding_width(a.model) if a.model else a.proj_dim
    if proj_dim is None or proj_dim <= 0:
        sys.exit(f"--proj-dim {proj_dim}: must be positive")
    if a.patch <= 0:
        sys.exit(f"--patch {a.patch}: must be positive")
    if qwen2vl:
        if not 0 < a.image_size <= 8192:
            sys.exit(f"--image-size {a.image_size}: must be in [1, 8192]")
        if a.merge != 2:
            sys.exit(f"--merge {a.merge}: qwen2vl merges 2x2 patches "
                     "(llama.cpp's merger is fixed at 2)")
    else:
        if a.image_size % a.patch != 0:
            sys.exit(f"--image-size {a.image_size}: not a multiple of --patch {a.patch}")
        side = a.image_size // a.patch
        if side % a.merge != 0:
            sys.exit(f"--merge {a.merge}: does not divide the {side} patches per side")
    if a.embd % a.heads != 0:
        sys.exit(f"--heads {a.heads}: does not divide --embd {a.embd}")
    if qwen2vl and (a.embd // a.heads) % 4 != 0:
        # clip.cpp's vision M-RoPE gives a quarter of each head to each of its 4 sections.
        sys.exit(f"--heads {a.heads}: qwen2vl needs a head width (--embd / --heads = "
                 f"{a.embd // a.heads}) that is a multiple of 4")
    if a.ff == a.embd:
        # clip.cpp takes ffn_down with ne[0] == n_embd for a legacy swapped up/down export.
        sys.exit(f"--ff {a.ff}: must differ from --embd (llama.cpp would read the MLP as swapped)")

    rng = np.random.default_rng(a.seed)

    def w(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    n = a.embd
    g = gguf.GGUFWriter(a.out, "clip")
    g.add_name(f"infkv-random-{a.type}-mmproj")
    g.add_description(f"random weights, seed {a.seed}: for tests of the mtmd path only")
    g.add_clip_has_vision_encoder(True)
    g.add_clip_projector_type("qwen2vl_merger" if qwen2vl else "gemma3")
    g.add_vision_image_size(a.image_size)
    g.add_vision_patch_size(a.patch)
    g.add_vision_embedding_length(n)
    g.add_vision_feed_forward_length(a.ff)
    g.add_vision_block_count(a.blocks)
    g.add_vision_head_count(a.heads)
    g.add_vision_projection_dim(proj_dim)
    g.add_vision_attention_layernorm_eps(1e-6)
    if qwen2vl:
        # No use_gelu / use_silu key: the blocks' MLP is quick GELU, as Qwen2-VL's.
        g.add_vision_image_mean(CLIP_MEAN)
        g.add_vision_image_std(CLIP_STD)
        g.add_vision_spatial_merge_size(a.merge)
    else:
        g.add_vision_image_mean([0.5, 0.5, 0.5])
        g.add_vision_image_std([0.5, 0.5, 0.5])
        g.add_vision_use_gelu(True)
        g.add_vision_projector_scale_factor(a.merge)

    # numpy shapes are ggml's ne reversed: the conv kernel is ne [patch, patch, 3, n_embd].
    conv_scale = (3 * a.patch * a.patch) ** -0.5
    if qwen2vl:
        # Qwen2-VL's temporal patch of 2 as two kernels, summed; no bias (clip.cpp asserts none).
        g.add_tensor("v.patch_embd.weight", w(n, 3, a.patch, a.patch, scale=conv_scale / 2**0.5))
        g.add_tensor("v.patch_embd.weight.1", w(n, 3, a.patch, a.patch, scale=conv_scale / 2**0.5))
    else:
        g.add_tensor("v.patch_embd.weight", w(n, 3, a.patch, a.patch, scale=conv_scale))
        g.add_tensor("v.patch_embd.bias", w(n, scale=0.02))
        g.add_tensor("v.position_embd.weight", w(side * side, n, scale=0.02))
    for i in range(a.blocks):
        p = f"v.blk.{i}"
        for name in ("attn_q", "attn_k", "attn_v", "attn_out"):
            g.add_tensor(f"{p}.{name}.weight", w(n, n, scale=n**-0.5))
            g.add_tensor(f"{p}.{name}.bias", w(n, scale=0.02))
        g.add_tensor(f"{p}.ln1.weight", norm(n))
        g.add_tensor(f"{p}.ln1.bias", w(n, scale=0.02))
        g.add_tensor(f"{p}.ln2.weight", norm(n))
        g.add_tensor(f"{p}.ln2.bias", w(n, scale=0.02))
        g.add_tensor(f"{p}.ffn_up.weight", w(a.ff, n, scale=n**-0.5))
        g.add_tensor(f"{p}.ffn_up.bias", w(a.ff, scale=0.02))
        g.add_tensor(f"{p}.ffn_down.weight", w(n, a.ff, scale=a.ff**-0.5))
        g.add_tensor(f"{p}.ffn_down.bias", w(n, scale=0.02))
    g.add_tensor("v.post_ln.weight", norm(n))
    g.add_tensor("v.post_ln.bias", w(n, scale=0.02))
    if qwen2vl:
        # The merger: each 2x2 block of patches (4 * n_embd wide) through mm.0, GELU, mm.2.
        m = 4 * n
        g.add_tensor("mm.0.weight", w(m, m, scale=m**-0.5))
        g.add_tensor("mm.0.bias", w(m, scale=0.02))
        g.add_tensor("mm.2.weight", w(proj_dim, m, scale=m**-0.5))
        g.add_tensor("mm.2.bias", w(proj_dim, scale=0.02))
    else:
        # Gemma 3's projector: ne [proj_dim, n_embd] (clip.cpp multiplies by its transpose).
        g.add_tensor("mm.soft_emb_norm.weight", norm(n))
        g.add_tensor("mm.input_projection.weight", w(n, proj_dim, scale=n**-0.5))

    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


if __name__ == "__main__":
    main()
