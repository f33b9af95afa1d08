#!/usr/bin/env python3
"""Writes a tiny random-weight llama-architecture GGUF for the llama.cpp adapter tests; with
--arch gemma3 a Gemma 3 one instead: Q/K norms, post-norms, and sliding-window attention on every
layer but each --swa-pattern-th (window --swa), whose RoPE base (--swa-theta) differs from the
global layers' (--theta): llama.cpp's iSWA cache and per-layer RoPE; with --arch qwen2vl a
Qwen2-VL one: Q/K/V biases and M-RoPE (llama_model_rope_type() is LLAMA_ROPE_TYPE_MROPE, four
positions per token), the head's rotary pairs split into --rope-sections (t, y, x, unused; they
must sum to head_dim / 2, default 2 3 3 0 for head_dim 16, Qwen2-VL's 16:24:24:0 scaled down).

Usage: make_tiny_llama.py OUT.gguf --layers N [--arch llama|gemma3|qwen2vl] [--seed S]
       [--embd 64] [--heads 4] [--kv-heads 2] [--vocab 128] [--ctx 512] [--theta 10000]
       [--swa 16] [--swa-pattern 2] [--swa-theta 100] [--rope-sections T Y X E]

Needs gguf-py (llama.cpp's gguf-py/ on PYTHONPATH) and numpy. The vocabulary is a placeholder
("none" tokenizer with `vocab_size` ids): the tests feed token ids directly. A qwen2vl model gets
llama.cpp's "test" tokenizer instead (text hashes to ids; token texts only for the specials,
<|vision_start|> and the like, as the last ids): mtmd_tokenize tokenizes the
<|vision_start|>/<|vision_end|> around each image, which the "none" tokenizer cannot.
"""
import argparse

import numpy as np
import gguf

# Qwen2-VL's special tokens (a subset, in its order), the last ids of a qwen2vl model's vocabulary.
QWEN2VL_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--embd", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ff", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--theta", type=float, default=10000.0)
    ap.add_argument("--arch", choices=["llama", "gemma3", "qwen2vl"], default="llama")
    ap.add_argument("--swa", type=int, default=16)
    ap.add_argument("--swa-pattern", type=int, default=2)
    ap.add_argument("--swa-theta", type=float, default=100.0)
    ap.add_argument("--rope-sections", type=int, nargs=4, metavar=("T", "Y", "X", "E"),
                    help="qwen2vl: rotary pairs per M-RoPE section (sum head_dim / 2)")
    a = ap.parse_args()
    gemma = a.arch == "gemma3"
    qwen2vl = a.arch == "qwen2vl"

    head_dim = a.embd // a.heads
    if qwen2vl:
        if a.embd % a.heads != 0 or head_dim % 2 != 0:
            ap.error(f"--heads {a.heads}: qwen2vl needs --embd {a.embd} = heads * an even head_dim")
        half = head_dim // 2
        if a.rope_sections is None:
            t = half // 4
            a.rope_sections = [t, (half - t) // 2, half - t - (half - t) // 2, 0]
        if min(a.rope_sections) < 0 or sum(a.rope_sections) != half:
            ap.error(f"--rope-sections {' '.join(map(str, a.rope_sections))}: must be non-negative "
                     f"and sum to head_dim / 2 = {half}")
        if a.vocab < len(QWEN2VL_SPECIALS) + 1:
            ap.error(f"--vocab {a.vocab}: qwen2vl needs more ids than its "
                     f"{len(QWEN2VL_SPECIALS)} special tokens")
    elif a.rope_sections is not None:
        ap.error("--rope-sections: only with --arch qwen2vl")
    rng = np.random.default_rng(a.seed)

    def w(rows: int, cols: int, scale: float) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def bias(n: int) -> np.ndarray:
        return (0.02 * rng.standard_normal(n)).astype(np.float32)

    g = gguf.GGUFWriter(a.out, a.arch)
    g.add_name("infkv-tiny-" + a.arch)
    g.add_block_count(a.layers)
    g.add_context_length(a.ctx)
    g.add_embedding_length(a.embd)
    g.add_feed_forward_length(a.ff)
    g.add_head_count(a.heads)
    g.add_head_count_kv(a.kv_heads)
    g.add_rope_dimension_count(head_dim)
    g.add_rope_freq_base(a.theta)
    g.add_layer_norm_rms_eps(1e-5)
    if gemma:
        g.add_key_length(head_dim)
        g.add_value_length(head_dim)
        g.add_sliding_window(a.swa)
        g.add_sliding_window_pattern(a.swa_pattern)
        g.add_rope_freq_base_swa(a.swa_theta)
    if qwen2vl:
        g.add_rope_dimension_sections(a.rope_sections)
    g.add_file_type(gguf.LlamaFileType.ALL_F32)
    g.add_vocab_size(a.vocab)
    if qwen2vl:
        n_plain = a.vocab - len(QWEN2VL_SPECIALS)
        g.add_tokenizer_model("test")
        g.add_token_list([f"[{i}]" for i in range(n_plain)] + QWEN2VL_SPECIALS)
        g.add_token_types([gguf.TokenType.NORMAL] * n_plain
                          + [gguf.TokenType.CONTROL] * len(QWEN2VL_SPECIALS))
    else:
        g.add_tokenizer_model("none")

    s_in = 1.0 / np.sqrt(a.embd)
    # Large query/key weights make attention peaked, so that evicting tokens visibly matters.
    g.add_tensor("token_embd.weight", w(a.vocab, a.embd, 1.0))
    for i in range(a.layers):
        p = f"blk.{i}."
        g.add_tensor(p + "attn_norm.weight", norm(a.embd))
        g.add_tensor(p + "attn_q.weight", w(a.heads * head_dim, a.embd, 3.0 * s_in))
        g.add_tensor(p + "attn_k.weight", w(a.kv_heads * head_dim, a.embd, 3.0 * s_in))
        g.add_tensor(p + "attn_v.weight", w(a.kv_heads * head_dim, a.embd, s_in))
        g.add_tensor(p + "attn_output.weight", w(a.embd, a.heads * head_dim, s_in))
        if qwen2vl:
            g.add_tensor(p + "attn_q.bias", bias(a.heads * head_dim))
            g.add_tensor(p + "attn_k.bias", bias(a.kv_heads * head_dim))
            g.add_tensor(p + "attn_v.bias", bias(a.kv_heads * head_dim))
        if gemma:
            g.add_tensor(p + "attn_q_norm.weight", norm(head_dim))
            g.add_tensor(p + "attn_k_norm.weight", norm(head_dim))
            g.add_tensor(p + "post_attention_norm.weight", norm(a.embd))
            g.add_tensor(p + "post_ffw_norm.weight", norm(a.embd))
        g.add_tensor(p + "ffn_norm.weight", norm(a.embd))
        g.add_tensor(p + "ffn_gate.weight", w(a.ff, a.embd, s_in))
        g.add_tensor(p + "ffn_up.weight", w(a.ff, a.embd, s_in))
        g.add_tensor(p + "ffn_down.weight", w(a.embd, a.ff, 1.0 / np.sqrt(a.ff)))
    g.add_tensor("output_norm.weight", norm(a.embd))
    g.add_tensor("output.weight", w(a.vocab, a.embd, s_in))

    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()


if __name__ == "__main__":
    main()
