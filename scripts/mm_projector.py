#!/usr/bin/env python3
"""Writes a random-weight Gemma 3 vision projector GGUF (an "mmproj" file) that llama.cpp's mtmd
library loads next to a Gemma 3 text model: a small SigLIP vision tower (patch embedding, learned
position embedding, --blocks pre-norm transformer blocks with biased attention and a GELU MLP,
post layer norm) followed by Gemma 3's projector (average pooling by --merge on each side, RMS
norm `mm.soft_emb_norm.weight`, projection `mm.input_projection.weight` to the text model's
embedding width). The weights are seeded noise: the embeddings it produces mean nothing, but
every step of the real path (load, preprocess, encode, decode as embeddings) runs.

The projection width must equal the text model's input embedding width (mtmd_init_from_file
refuses a mismatch): pass the text model with --model (its `<arch>.embedding_length` is read) or
give --proj-dim.

An image becomes ((image_size / patch) / merge)^2 tokens: 64 with the defaults.

Usage: mm_projector.py OUT.gguf (--model TEXT_MODEL.gguf | --proj-dim N) [--seed S]
       [--image-size 224] [--patch 14] [--merge 2] [--embd 64] [--heads 4] [--ff 128]
       [--blocks 2]

Needs gguf-py (llama.cpp's gguf-py/ on PYTHONPATH) and numpy.
"""
import argparse
import sys

import numpy as np
import gguf


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
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--patch", type=int, default=14)
    ap.add_argument("--merge", type=int, default=2, help="pooling kernel per side (Gemma 3's own is 4)")
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--ff", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=2)
    a = ap.parse_args()

    proj_dim = text_embedding_width(a.model) if a.model else a.proj_dim
    if proj_dim is None or proj_dim <= 0:
        sys.exit(f"--proj-dim {proj_dim}: must be positive")
    if a.image_size % a.patch != 0:
        sys.exit(f"--image-size {a.image_size}: not a multiple of --patch {a.patch}")
    side = a.image_size // a.patch
    if side % a.merge != 0:
        sys.exit(f"--merge {a.merge}: does not divide the {side} patches per side")
    if a.embd % a.heads != 0:
        sys.exit(f"--heads {a.heads}: does not divide --embd {a.embd}")
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
    g.add_name("infkv-random-gemma3-mmproj")
    g.add_description(f"random weights, seed {a.seed}: for tests of the mtmd path only")
    g.add_clip_has_vision_encoder(True)
    g.add_clip_projector_type("gemma3")
    g.add_vision_image_size(a.image_size)
    g.add_vision_patch_size(a.patch)
    g.add_vision_embedding_length(n)
    g.add_vision_feed_forward_length(a.ff)
    g.add_vision_block_count(a.blocks)
    g.add_vision_head_count(a.heads)
    g.add_vision_projection_dim(proj_dim)
    g.add_vision_attention_layernorm_eps(1e-6)
    g.add_vision_image_mean([0.5, 0.5, 0.5])
    g.add_vision_image_std([0.5, 0.5, 0.5])
    g.add_vision_use_gelu(True)
    g.add_vision_projector_scale_factor(a.merge)

    # numpy shapes are ggml's ne reversed: the conv kernel is ne [patch, patch, 3, n_embd].
    g.add_tensor("v.patch_embd.weight", w(n, 3, a.patch, a.patch, scale=(3 * a.patch * a.patch) ** -0.5))
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
    # Gemma 3's projector: ne [proj_dim, n_embd] (clip.cpp multiplies by its transpose).
    g.add_tensor("mm.soft_emb_norm.weight", norm(n))
    g.add_tensor("mm.input_projection.weight", w(n, proj_dim, scale=n**-0.5))

    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


if __name__ == "__main__":
    main()
