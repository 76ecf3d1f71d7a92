"""Mid-size GGUF files for bench:dsa and bench:engine's deepseek32 / glm-dsa / minimax-m2 rows, written with llama.cpp's
own writer (gguf-py) the way its converter writes the released checkpoints (the keys and tensor layout of
test/support/convertedModels.py's deepseek2 / minimax_m2, at a larger shape). Seeded (fixed) F16 matrices, F32 vectors.

usage: python3 dsaModel.py GGUF_PY_DIR FAMILY OUT.gguf TOKENIZER.gguf TOP_K [SEED]

FAMILY: deepseek32 (DeepSeek-V3.2), glm-dsa (GLM-5) or minimax-m2. The DSA shape is DeepSeek-V3.2's proportions scaled
to hidden 1024: 16 heads, q_lora 512, kv_lora 512, qk_nope 128, qk_rope 64, v_head 128, an indexer of 16 heads of 128
with TOP_K, block 0 dense (FFN 2816), block 1 routed (16 experts of 512, 4 used, 4 groups of which 2, one shared
expert), the MTP block the converter appends. minimax-m2: hidden 1024, 8 heads / 2 KV heads of 128 (RoPE over 64),
3 blocks of 16 experts of 512, 4 used (TOP_K unused). The tokenizer (512 tokens) is TOKENIZER.gguf's.
"""

import sys

import numpy as np

gguf_py, family, out_path, tokenizer_path, top_k = sys.argv[1:6]
seed = int(sys.argv[6]) if len(sys.argv) > 6 else 1
sys.path.insert(0, gguf_py)
import gguf  # noqa: E402

rng = np.random.default_rng(seed)
W = 0.03


def matrix(*shape, scale=W):
    return (rng.standard_normal(shape) * scale).astype(np.float16)


def vector(n, around=1.0, spread=0.05):
    return (around + rng.standard_normal(n) * spread).astype(np.float32)


def copy_tokenizer(writer, path):
    reader = gguf.GGUFReader(path)
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        elif kind == gguf.GGUFValueType.STRING:
            writer.add_string(name, field.contents())
        elif kind == gguf.GGUFValueType.UINT32:
            writer.add_uint32(name, int(field.contents()))
        elif kind == gguf.GGUFValueType.INT32:
            writer.add_int32(name, int(field.contents()))
        elif kind == gguf.GGUFValueType.FLOAT32:
            writer.add_float32(name, float(field.contents()))
        elif kind == gguf.GGUFValueType.BOOL:
            writer.add_bool(name, bool(field.contents()))
    return len(reader.fields["tokenizer.ggml.tokens"].data)


def routed(writer, b, n_embd, n_exp, n_ff_exp):
    writer.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((n_exp, n_embd)) * 0.5).astype(np.float32))
    writer.add_tensor(b + "exp_probs_b.bias", vector(n_exp, 0.0, 0.1))
    writer.add_tensor(b + "ffn_gate_exps.weight", matrix(n_exp, n_ff_exp, n_embd))
    writer.add_tensor(b + "ffn_up_exps.weight", matrix(n_exp, n_ff_exp, n_embd))
    writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, n_embd, n_ff_exp))


def dsa(writer, n_vocab, glm):
    n_trunk, n_embd, n_head, n_ff = 2, 1024, 16, 2816
    q_lora, kv_lora, nope, rope, v = 512, 512, 128, 64, 128
    n_exp, n_used, n_ff_exp, n_group, topk_group = 16, 4, 512, 4, 2
    ix_heads, ix_dim = 16, 128
    writer.add_block_count(n_trunk + 1)
    writer.add_context_length(163840)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(1)
    if not glm:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(40.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
        writer.add_rope_scaling_yarn_beta_fast(32.0)
        writer.add_rope_scaling_yarn_beta_slow(1.0)
    writer.add_rope_freq_base(10_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(n_exp)
    writer.add_expert_used_count(n_used)
    writer.add_expert_group_count(n_group)
    writer.add_expert_group_used_count(topk_group)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_leading_dense_block_count(1)
    writer.add_vocab_size(n_vocab)
    writer.add_q_lora_rank(q_lora)
    writer.add_kv_lora_rank(kv_lora)
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v)
    writer.add_expert_feed_forward_length(n_ff_exp)
    writer.add_expert_shared_count(1)
    writer.add_expert_weights_scale(2.5)
    writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope)
    if not glm:
        writer.add_rope_scaling_yarn_log_mul(0.1)
    writer.add_nextn_predict_layers(1)
    writer.add_indexer_head_count(ix_heads)
    writer.add_indexer_key_length(ix_dim)
    writer.add_indexer_top_k(int(top_k))

    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd))
    for il in range(n_trunk + 1):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "indexer.k_norm.weight", vector(ix_dim))
        writer.add_tensor(b + "indexer.k_norm.bias", vector(ix_dim, 0.0, 0.1))
        writer.add_tensor(b + "indexer.proj.weight", matrix(ix_heads, n_embd))
        writer.add_tensor(b + "indexer.attn_k.weight", matrix(ix_dim, n_embd))
        writer.add_tensor(b + "indexer.attn_q_b.weight", matrix(ix_heads * ix_dim, q_lora))
        writer.add_tensor(b + "attn_q_a.weight", matrix(q_lora, n_embd))
        writer.add_tensor(b + "attn_q_a_norm.weight", vector(q_lora))
        writer.add_tensor(b + "attn_q_b.weight", matrix(n_head * (nope + rope), q_lora))
        writer.add_tensor(b + "attn_kv_a_mqa.weight", matrix(kv_lora + rope, n_embd))
        writer.add_tensor(b + "attn_kv_a_norm.weight", vector(kv_lora))
        kv_b = matrix(n_head * (nope + v), kv_lora).reshape(n_head, nope + v, kv_lora)
        writer.add_tensor(b + "attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1)))
        writer.add_tensor(b + "attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:, :]))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * v))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        if il == 0:
            writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd))
            writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd))
            writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff))
        else:
            routed(writer, b, n_embd, n_exp, n_ff_exp)
            writer.add_tensor(b + "ffn_gate_shexp.weight", matrix(n_ff_exp, n_embd))
            writer.add_tensor(b + "ffn_up_shexp.weight", matrix(n_ff_exp, n_embd))
            writer.add_tensor(b + "ffn_down_shexp.weight", matrix(n_embd, n_ff_exp))
        if il >= n_trunk:
            writer.add_tensor(b + "nextn.eh_proj.weight", matrix(n_embd, 2 * n_embd))
            writer.add_tensor(b + "nextn.enorm.weight", vector(n_embd))
            writer.add_tensor(b + "nextn.hnorm.weight", vector(n_embd))
            writer.add_tensor(b + "nextn.shared_head_norm.weight", vector(n_embd))


def minimax_m2(writer, n_vocab):
    n_layer, n_embd, n_head, n_kv, hd, n_rot = 3, 1024, 8, 2, 128, 64
    n_exp, n_used, n_ff = 16, 4, 512
    writer.add_block_count(n_layer)
    writer.add_context_length(196608)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(5_000_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_expert_count(n_exp)
    writer.add_expert_used_count(n_used)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_expert_feed_forward_length(n_ff)
    writer.add_rope_dimension_count(n_rot)
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd))
    for il in range(n_layer):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd))
        writer.add_tensor(b + "attn_k.weight", matrix(n_kv * hd, n_embd))
        writer.add_tensor(b + "attn_v.weight", matrix(n_kv * hd, n_embd))
        writer.add_tensor(b + "attn_q_norm.weight", vector(n_head * hd))
        writer.add_tensor(b + "attn_k_norm.weight", vector(n_kv * hd))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        routed(writer, b, n_embd, n_exp, n_ff)


FAMILIES = {
    "deepseek32": lambda w, n: dsa(w, n, glm=False),
    "glm-dsa": lambda w, n: dsa(w, n, glm=True),
    "minimax-m2": minimax_m2,
}
if family not in FAMILIES:
    sys.exit(f"unknown family {family!r} (known: {', '.join(sorted(FAMILIES))})")
writer = gguf.GGUFWriter(out_path, family)
writer.add_name(f"bench-{family}")
vocab = copy_tokenizer(writer, tokenizer_path)
FAMILIES[family](writer, vocab)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
