"""Tiny GGUF files written the way llama.cpp's converter (convert_hf_to_gguf.py) writes a family's released
checkpoints, with llama.cpp's own writer (gguf-py), so that a mistake shared by swactor's writer (`swactor synth`)
and its engine cannot hide. Shapes follow each family's released config.json, scaled down; the keys are those the
converter's model class writes (conversion/*.py in the llama.cpp source node-llama-cpp ships).

usage: python3 convertedModels.py GGUF_PY_DIR FAMILY[+fused][+q8_0] OUT.gguf TOKENIZER.gguf [SEED [SPLIT]]

SPLIT writes a split set as gguf-py does for `--split-max-tensors` (parts OUT-00001-of-0000N.gguf, the metadata in the
first, split.no / split.count / split.tensors.count in each): a JSON object with `maxTensors` (gguf-py's own cut),
`cuts` (tensor names that start a new part, for a part that holds exactly one block) and `smallFirst` (a first part
with the metadata only, as `--no-tensor-first-split` writes).

The tokenizer (its tokenizer.* keys) is copied from TOKENIZER.gguf, so both sides tokenize alike; weights are
seeded normal values (F16 matrices and F32 vectors, as `--outtype f16` writes them).
"""

import sys

import numpy as np

gguf_py, family, out_path, tokenizer_path = sys.argv[1:5]
# "<family>+fused": the routed experts' gate and up as one tensor, as `convert_hf_to_gguf.py --fuse-gate-up-exps` writes
# "<family>+q8_0": F16 matrices whose rows are whole Q8_0 blocks written as Q8_0 (llama-quantize's output for them)
family, *suffixes = family.split("+")
FUSE = "fused" in suffixes
Q8 = "q8_0" in suffixes
seed = int(sys.argv[5]) if len(sys.argv) > 5 else 1
split = __import__("json").loads(sys.argv[6]) if len(sys.argv) > 6 else {}
sys.path.insert(0, gguf_py)
import gguf  # noqa: E402

rng = np.random.default_rng(seed)


def matrix(*shape, scale=0.08):
    """A weight in numpy order (rows last in ggml's ne): F16, as the converter writes matrices."""
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


def experts_gate_up(writer, b, n_exp, n_ff_exp, n_embd, scale):
    """The routed experts' gate and up: apart, or fused along the rows (gate first, ModelBase.modify_tensors)."""
    gate, up = matrix(n_exp, n_ff_exp, n_embd, scale=scale), matrix(n_exp, n_ff_exp, n_embd, scale=scale)
    if FUSE:
        writer.add_tensor(b + "ffn_gate_up_exps.weight", np.concatenate([gate, up], axis=1))
    else:
        writer.add_tensor(b + "ffn_gate_exps.weight", gate)
        writer.add_tensor(b + "ffn_up_exps.weight", up)


def glm4moe(writer, n_vocab):
    """GLM-4.5 / 4.5-Air / 4.6 (conversion/glm.py Glm4MoeModel), scaled down: head_dim set apart from
    hidden_size / heads (key_length), partial_rotary_factor 0.5 (rope.dimension_count = head_dim / 2), q/k/v biases
    (attention_bias), first_k_dense_replace 1, sigmoid routing with the correction bias, shared experts,
    routed_scaling_factor, norm_topk_prob, and one MTP block (num_nextn_predict_layers 1) after the trunk."""
    c = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_hidden_layers=4,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        partial_rotary_factor=0.5, rope_theta=1_000_000.0, rms_norm_eps=1e-5, max_position_embeddings=4096,
        num_nextn_predict_layers=1,
    )
    n_embd, n_head, n_kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    n_block = c["num_hidden_layers"] + c["num_nextn_predict_layers"]
    # TextModel.set_gguf_parameters, then Glm4MoeModel's own keys, in the converter's order
    writer.add_block_count(n_block)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(c["n_routed_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_rope_dimension_count(int(hd * c["partial_rotary_factor"]))
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_shared_count(c["n_shared_experts"])
    writer.add_leading_dense_block_count(c["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(c["routed_scaling_factor"])
    writer.add_expert_weights_norm(c["norm_topk_prob"])
    writer.add_nextn_predict_layers(c["num_nextn_predict_layers"])

    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    n_exp, n_ff_exp, n_ff = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"]
    for il in range(n_block):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd))
        writer.add_tensor(b + "attn_k.weight", matrix(n_kv * hd, n_embd))
        writer.add_tensor(b + "attn_v.weight", matrix(n_kv * hd, n_embd))
        writer.add_tensor(b + "attn_q.bias", vector(n_head * hd, 0.0, 0.1))
        writer.add_tensor(b + "attn_k.bias", vector(n_kv * hd, 0.0, 0.1))
        writer.add_tensor(b + "attn_v.bias", vector(n_kv * hd, 0.0, 0.1))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd))
        writer.add_tensor(b + "post_attention_norm.weight", vector(n_embd))
        if il < c["first_k_dense_replace"]:
            writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd))
            writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd))
            writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff))
        else:
            writer.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((n_exp, n_embd)) * 0.3).astype(np.float32))
            writer.add_tensor(b + "exp_probs_b.bias", vector(n_exp, 0.0, 0.1))
            experts_gate_up(writer, b, n_exp, n_ff_exp, n_embd, 0.08)
            writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, n_embd, n_ff_exp))
            sh = n_ff_exp * c["n_shared_experts"]
            writer.add_tensor(b + "ffn_gate_shexp.weight", matrix(sh, n_embd))
            writer.add_tensor(b + "ffn_up_shexp.weight", matrix(sh, n_embd))
            writer.add_tensor(b + "ffn_down_shexp.weight", matrix(n_embd, sh))
        if il >= c["num_hidden_layers"]:
            writer.add_tensor(b + "nextn.eh_proj.weight", matrix(n_embd, 2 * n_embd))
            writer.add_tensor(b + "nextn.enorm.weight", vector(n_embd))
            writer.add_tensor(b + "nextn.hnorm.weight", vector(n_embd))
            writer.add_tensor(b + "nextn.shared_head_norm.weight", vector(n_embd))


def dense(arch, c, n_vocab, writer, biases=False, qk_norm=False, rope_dim_key=False, vocab_key=False):
    """A llama-style dense decoder as TextModel.set_gguf_parameters and the family's class write it: head_dim in
    config.json gives key_length/value_length; tie_word_embeddings leaves output.weight out (the converter skips
    lm_head); rope_type llama3 adds rope_freqs.weight (LlamaModel.generate_extra_tensors)."""
    n_embd, n_head, n_kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    hd = c.get("head_dim", n_embd // n_head)
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    rope = c.get("rope_scaling")
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    if "head_dim" in c:
        writer.add_key_length(hd)
        writer.add_value_length(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if vocab_key:
        writer.add_vocab_size(n_vocab)
    if rope_dim_key:
        writer.add_rope_dimension_count(hd)

    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    if not c["tie_word_embeddings"]:
        writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    if rope is not None and rope["rope_type"] == "llama3":
        freqs = 1.0 / (c["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float32) / hd))
        low = rope["original_max_position_embeddings"] / rope["low_freq_factor"]
        high = rope["original_max_position_embeddings"] / rope["high_freq_factor"]
        factors = []
        for f in freqs:
            wavelen = 2 * np.pi / f
            if wavelen < high:
                factors.append(1.0)
            elif wavelen > low:
                factors.append(rope["factor"])
            else:
                smooth = (rope["original_max_position_embeddings"] / wavelen - rope["low_freq_factor"]) / (
                    rope["high_freq_factor"] - rope["low_freq_factor"]
                )
                factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    n_ff = c["intermediate_size"]
    # block weights large enough that each block moves the residual well away from the token's own embedding (with
    # tied embeddings, small ones leave a model that repeats its input token)
    w = 0.3
    for il in range(c["num_hidden_layers"]):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_k.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_v.weight", matrix(n_kv * hd, n_embd, scale=w))
        if biases:
            writer.add_tensor(b + "attn_q.bias", vector(n_head * hd, 0.0, 0.1))
            writer.add_tensor(b + "attn_k.bias", vector(n_kv * hd, 0.0, 0.1))
            writer.add_tensor(b + "attn_v.bias", vector(n_kv * hd, 0.0, 0.1))
        if qk_norm:
            writer.add_tensor(b + "attn_q_norm.weight", vector(hd))
            writer.add_tensor(b + "attn_k_norm.weight", vector(hd))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd, scale=w))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff, scale=w))


SMALL = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
             intermediate_size=128, rms_norm_eps=1e-5, max_position_embeddings=4096)


def llama(writer, n_vocab):
    """Llama 3.2 1B/3B (conversion/llama.py LlamaModel): tied embeddings, llama3 RoPE scaling (rope_freqs.weight),
    vocab_size and rope.dimension_count written."""
    c = dict(SMALL, rope_theta=500_000.0, tie_word_embeddings=True,
             rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                               original_max_position_embeddings=8192))
    dense("llama", c, n_vocab, writer, rope_dim_key=True, vocab_key=True)


def qwen2(writer, n_vocab):
    """Qwen2.5 0.5B-3B (conversion/qwen.py Qwen2Model): q/k/v biases, tied embeddings, no rope.dimension_count."""
    c = dict(SMALL, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    dense("qwen2", c, n_vocab, writer, biases=True)


def qwen3(writer, n_vocab):
    """Qwen3 0.6B-4B (Qwen3Model): head_dim 2x hidden / heads (key_length, value_length), q/k RMS norms, tied
    embeddings, no rope.dimension_count."""
    c = dict(SMALL, head_dim=32, rope_theta=1_000_000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    dense("qwen3", c, n_vocab, writer, qk_norm=True)


def qwen3moe(writer, n_vocab):
    """Qwen3-30B-A3B / 235B-A22B (conversion/qwen.py Qwen3MoeModel via Qwen2MoeModel): head_dim apart from
    hidden / heads, q/k norms, every block routed (softmax, top-k renormalised by llama.cpp's graph: the converter
    writes no expert_weights_norm), expert_feed_forward_length, intermediate_size written though no block uses it,
    its own output.weight."""
    c = dict(SMALL, head_dim=32, rope_theta=1_000_000.0, rms_norm_eps=1e-6, moe_intermediate_size=32,
             num_experts=8, num_experts_per_tok=3)
    n_embd, n_head, n_kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(c["num_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    n_exp, n_ff_exp, w = c["num_experts"], c["moe_intermediate_size"], 0.3
    for il in range(c["num_hidden_layers"]):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_k.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_v.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_q_norm.weight", vector(hd))
        writer.add_tensor(b + "attn_k_norm.weight", vector(hd))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd, scale=w))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((n_exp, n_embd)) * 0.5).astype(np.float32))
        experts_gate_up(writer, b, n_exp, n_ff_exp, n_embd, w)
        writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, n_embd, n_ff_exp, scale=w))


def gemma3(writer, n_vocab):
    """Gemma 3 4B/12B (conversion/gemma.py Gemma3Model): head_dim apart from hidden / heads, sliding_window written
    but no sliding_window_pattern (llama.cpp's default, every 6th block global), rope.freq_base_swa from
    rope_local_base_freq, linear RoPE scaling (factor 8) for the global blocks, tied embeddings, norms shifted by 1
    (Gemma3RMSNorm), q/k norms, post-attention and post-FFN norms."""
    c = dict(SMALL, num_hidden_layers=7, head_dim=32, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
             rms_norm_eps=1e-6, sliding_window=16, rope_scaling_factor=8.0)
    n_embd, n_head, n_kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    # TextModel.set_gguf_parameters (the linear scaling, the SWA base), then Gemma3Model's keys
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(c["rope_scaling_factor"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_rope_freq_base_swa(c["rope_local_base_freq"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_sliding_window(c["sliding_window"])
    # the graph scales embeddings by sqrt(hidden): small rows, so that the blocks (post-normed) are not drowned out
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.06))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    n_ff, w = c["intermediate_size"], 0.3
    for il in range(c["num_hidden_layers"]):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_k.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_v.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_q_norm.weight", vector(hd))
        writer.add_tensor(b + "attn_k_norm.weight", vector(hd))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd, scale=w))
        writer.add_tensor(b + "post_attention_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff, scale=w))
        writer.add_tensor(b + "post_ffw_norm.weight", vector(n_embd))


def gemma4(writer, n_vocab, moe=None, e2b=False):
    """Gemma 4 31B (conversion/gemma.py Gemma4Model), scaled down: layer_types as the per-block bool array
    sliding_window_pattern (5 sliding : 1 global), head_dim 256 sliding / global_head_dim 512 global (key_length vs
    key_length_swa), KV heads per block as an array (num_key_value_heads sliding, num_global_key_value_heads global),
    K = V on the global blocks (attention_k_eq_v: no attn_v there), "proportional" RoPE on the global blocks
    (partial_rotary_factor 0.25 as rope_freqs.weight: 1 on the rotated pairs, 1e30 on the rest; rope.dimension_count the
    whole global head), rope.freq_base_swa, the layer scalar (layer_output_scale), final soft-capping 30, norms written
    as they are (no +1 shift), shared_kv_layers 0 and embedding_length_per_layer_input 0 written, tied embeddings."""
    n_layer, n_embd, n_head, n_ff = 8, 64, 8, 128
    kv_swa, kv_full, hd_swa, hd_full, window = 4, 2, 16, 32, 16
    layer_types = ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    n_shared, n_pl, k_eq_v = 0, 0, True
    if e2b:
        # E2B: 4 sliding : 1 global, one KV head everywhere (no num_global_key_value_heads: head_count_kv stays one
        # number), V on every block, per-layer embeddings, the last blocks reading earlier blocks' KV
        # (num_kv_shared_layers), and use_double_wide_mlp (feed_forward_length per block, 2x on the shared blocks)
        n_layer, kv_swa, kv_full, n_shared, n_pl, k_eq_v = 10, 1, 1, 5, 16, False
        layer_types = (["sliding_attention"] * 4 + ["full_attention"]) * 2
    swa = [t == "sliding_attention" for t in layer_types]
    # TextModel.set_gguf_parameters ("proportional" is no rope scaling type), then Gemma3Model's, then Gemma4Model's
    writer.add_block_count(n_layer)
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(kv_swa)
    writer.add_rope_freq_base(1_000_000.0)
    writer.add_rope_freq_base_swa(10_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_key_length(hd_swa)
    writer.add_value_length(hd_swa)
    writer.add_final_logit_softcapping(30.0)
    writer.add_sliding_window(window)
    writer.add_shared_kv_layers(n_shared)
    writer.add_embedding_length_per_layer_input(n_pl)
    writer.add_sliding_window_pattern(swa)
    writer.add_key_length(hd_full)
    writer.add_value_length(hd_full)
    writer.add_key_length_swa(hd_swa)
    writer.add_value_length_swa(hd_swa)
    ffs = [n_ff if il < n_layer - n_shared else 2 * n_ff for il in range(n_layer)]
    if e2b:
        writer.add_feed_forward_length(ffs)
    else:
        writer.add_head_count_kv([kv_swa if s else kv_full for s in swa])
    writer.add_rope_dimension_count(hd_full)
    writer.add_rope_dimension_count_swa(hd_swa)
    if moe is not None:
        writer.add_expert_count(moe["num_experts"])
        writer.add_expert_used_count(moe["top_k_experts"])
        writer.add_expert_feed_forward_length(moe["moe_intermediate_size"])
    # generate_extra_tensors: the global blocks' proportional RoPE
    n_rot = int(hd_full * 0.25 / 2)
    writer.add_tensor("rope_freqs.weight", np.array([1.0] * n_rot + [1e30] * (hd_full // 2 - n_rot), dtype=np.float32))
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.06))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    if n_pl > 0:
        writer.add_tensor("per_layer_token_embd.weight", matrix(n_vocab, n_pl * n_layer, scale=0.06))
        writer.add_tensor("per_layer_model_proj.weight", matrix(n_pl * n_layer, n_embd, scale=0.1))
        writer.add_tensor("per_layer_proj_norm.weight", vector(n_pl))
    w = 0.3
    for il in range(n_layer):
        b = f"blk.{il}."
        hd, kv = (hd_swa, kv_swa) if swa[il] else (hd_full, kv_full)
        n_ff = ffs[il]
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_k.weight", matrix(kv * hd, n_embd, scale=w))
        if swa[il] or not k_eq_v:
            writer.add_tensor(b + "attn_v.weight", matrix(kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_q_norm.weight", vector(hd))
        writer.add_tensor(b + "attn_k_norm.weight", vector(hd))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd, scale=w))
        writer.add_tensor(b + "post_attention_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff, scale=w))
        writer.add_tensor(b + "post_ffw_norm.weight", vector(n_embd))
        writer.add_tensor(b + "layer_output_scale.weight", vector(1, around=0.7, spread=0.1))
        if n_pl > 0:
            writer.add_tensor(b + "inp_gate.weight", matrix(n_pl, n_embd, scale=w))
            writer.add_tensor(b + "proj.weight", matrix(n_embd, n_pl, scale=w))
            writer.add_tensor(b + "post_norm.weight", vector(n_embd))
        if moe is not None:
            # the checkpoint's router.proj / router.scale / router.per_expert_scale, experts.gate_up_proj (mapped fused
            # as it is: gate rows first) and experts.down_proj, and the MoE branch's own norms
            n_exp, n_ff_exp = moe["num_experts"], moe["moe_intermediate_size"]
            writer.add_tensor(b + "ffn_gate_inp.weight", matrix(n_exp, n_embd, scale=0.5))
            writer.add_tensor(b + "ffn_gate_inp.scale", vector(n_embd))
            writer.add_tensor(b + "ffn_down_exps.scale", vector(n_exp, around=1.0, spread=0.2))
            writer.add_tensor(b + "ffn_gate_up_exps.weight", matrix(n_exp, 2 * n_ff_exp, n_embd, scale=w))
            writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, n_embd, n_ff_exp, scale=w))
            writer.add_tensor(b + "pre_ffw_norm_2.weight", vector(n_embd))
            writer.add_tensor(b + "post_ffw_norm_1.weight", vector(n_embd))
            writer.add_tensor(b + "post_ffw_norm_2.weight", vector(n_embd))


def gemma4_e2b(writer, n_vocab):
    """Gemma 4 E2B (Gemma4Model): per-layer embeddings, shared KV layers, the double-wide MLP of the shared blocks."""
    gemma4(writer, n_vocab, e2b=True)


def gemma4_moe(writer, n_vocab):
    """Gemma 4 26B-A4B (Gemma4Model with experts): the 31B block plus routed GELU experts beside the dense
    feed-forward, 128 experts top-8 in the release (here 16 top-4), expert_feed_forward_length from
    moe_intermediate_size, the experts' gate and up fused as the checkpoint stores them."""
    gemma4(writer, n_vocab, moe=dict(num_experts=16, top_k_experts=4, moe_intermediate_size=32))


def mistral3(writer, n_vocab):
    """Ministral 3 3B (conversion/mistral3.py Ministral3Model, a LlamaModel): YaRN (factor, original context,
    beta_fast/slow from rope_parameters), yarn_log_multiplier from mscale_all_dim, the attention temperature
    (llama_4_scaling_beta), head_dim apart from hidden / heads, tied embeddings. The original context is scaled down
    with the model (16 positions), so the test's positions cross it and the temperature applies."""
    c = dict(SMALL, head_dim=32, rope_theta=1_000_000.0, tie_word_embeddings=True, max_position_embeddings=256,
             rope=dict(factor=16.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                       mscale_all_dim=1.0, llama_4_scaling_beta=0.1))
    n_embd, n_head, n_kv, hd, r = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rope"]
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(r["factor"])
    writer.add_rope_scaling_orig_ctx_len(r["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(r["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(r["beta_slow"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(n_vocab)
    writer.add_rope_dimension_count(hd)
    writer.add_rope_scaling_yarn_log_mul(r["mscale_all_dim"])
    writer.add_attn_temperature_scale(r["llama_4_scaling_beta"])
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    n_ff, w = c["intermediate_size"], 0.3
    for il in range(c["num_hidden_layers"]):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_k.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_v.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd, scale=w))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff, scale=w))


def deepseek2(writer, n_vocab, dsa=None, yarn=True):
    """DeepSeek-V3 / R1 and Kimi K2 (conversion/deepseek.py DeepseekV2Model), scaled down: MLA written as MQA over
    the latent (head_count_kv 1, key_length = kv_lora + rope, value_length = kv_lora, the *_mla lengths) with
    kv_b_proj split into attn_k_b (transposed) and attn_v_b; v_head_dim apart from qk_nope + qk_rope; q_lora;
    group-limited sigmoid routing (n_group, topk_group) with the correction bias, shared experts, one dense block;
    YaRN with yarn_log_multiplier = 0.1 x mscale_all_dim; the MTP layer skipped as the converter skips it."""
    c = dict(SMALL, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
             n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
             moe_intermediate_size=32, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             rope_theta=10_000.0, rms_norm_eps=1e-6, max_position_embeddings=640,
             rope=dict(factor=40.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
                       mscale_all_dim=1.0))
    n_embd, n_head, r = c["hidden_size"], c["num_attention_heads"], c["rope"]
    nope, rope, v, q_lora, kv_lora = (c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                                      c["q_lora_rank"], c["kv_lora_rank"])
    # TextModel.set_gguf_parameters (num_key_value_heads forced to 1), then DeepseekV2Model's keys
    writer.add_block_count(c["num_hidden_layers"] + (0 if dsa is None else 1))
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(1)
    if yarn:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(r["factor"])
        writer.add_rope_scaling_orig_ctx_len(r["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(r["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(r["beta_slow"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(c["n_routed_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_expert_group_count(c["n_group"])
    writer.add_expert_group_used_count(c["topk_group"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_leading_dense_block_count(c["first_k_dense_replace"])
    writer.add_vocab_size(n_vocab)
    writer.add_q_lora_rank(q_lora)
    writer.add_kv_lora_rank(kv_lora)
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v)
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_shared_count(c["n_shared_experts"])
    writer.add_expert_weights_scale(c["routed_scaling_factor"])
    writer.add_expert_weights_norm(c["norm_topk_prob"])
    writer.add_rope_dimension_count(rope)
    if yarn:
        writer.add_rope_scaling_yarn_log_mul(0.1 * r["mscale_all_dim"])
    n_trunk = c["num_hidden_layers"]
    n_block = n_trunk
    if dsa is not None:
        # DeepseekV32Model / GlmMoeDsaModel: the MTP block appended after the trunk, then the indexer's keys
        n_block += 1
        writer.add_nextn_predict_layers(1)
        writer.add_indexer_head_count(dsa["index_n_heads"])
        writer.add_indexer_key_length(dsa["index_head_dim"])
        writer.add_indexer_top_k(dsa["index_topk"])
        if dsa.get("indexer_types") is not None:
            writer.add_indexer_types([t == "full" for t in dsa["indexer_types"]])

    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    n_exp, n_ff_exp, n_ff, w = c["n_routed_experts"], c["moe_intermediate_size"], c["intermediate_size"], 0.3
    for il in range(n_block):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        if dsa is not None and (il >= n_trunk or dsa.get("indexer_types") is None or dsa["indexer_types"][il] == "full"):
            d, nh = dsa["index_head_dim"], dsa["index_n_heads"]
            writer.add_tensor(b + "indexer.k_norm.weight", vector(d))
            writer.add_tensor(b + "indexer.k_norm.bias", vector(d, 0.0, 0.1))
            writer.add_tensor(b + "indexer.proj.weight", matrix(nh, n_embd, scale=w))
            writer.add_tensor(b + "indexer.attn_k.weight", matrix(d, n_embd, scale=w))
            writer.add_tensor(b + "indexer.attn_q_b.weight", matrix(nh * d, q_lora, scale=w))
        writer.add_tensor(b + "attn_q_a.weight", matrix(q_lora, n_embd, scale=w))
        writer.add_tensor(b + "attn_q_a_norm.weight", vector(q_lora))
        writer.add_tensor(b + "attn_q_b.weight", matrix(n_head * (nope + rope), q_lora, scale=w))
        writer.add_tensor(b + "attn_kv_a_mqa.weight", matrix(kv_lora + rope, n_embd, scale=w))
        writer.add_tensor(b + "attn_kv_a_norm.weight", vector(kv_lora))
        # kv_b_proj [heads x (nope + v), kv_lora], split per head and k_b transposed, as modify_tensors does
        kv_b = matrix(n_head * (nope + v), kv_lora, scale=w).reshape(n_head, nope + v, kv_lora)
        writer.add_tensor(b + "attn_k_b.weight", np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1)))
        writer.add_tensor(b + "attn_v_b.weight", np.ascontiguousarray(kv_b[:, nope:, :]))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * v, scale=w))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        if il < c["first_k_dense_replace"]:
            writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd, scale=w))
            writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd, scale=w))
            writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff, scale=w))
        else:
            writer.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((n_exp, n_embd)) * 0.5).astype(np.float32))
            writer.add_tensor(b + "exp_probs_b.bias", vector(n_exp, 0.0, 0.1))
            experts_gate_up(writer, b, n_exp, n_ff_exp, n_embd, w)
            writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, n_embd, n_ff_exp, scale=w))
            sh = n_ff_exp * c["n_shared_experts"]
            writer.add_tensor(b + "ffn_gate_shexp.weight", matrix(sh, n_embd, scale=w))
            writer.add_tensor(b + "ffn_up_shexp.weight", matrix(sh, n_embd, scale=w))
            writer.add_tensor(b + "ffn_down_shexp.weight", matrix(n_embd, sh, scale=w))
        if il >= n_trunk:
            writer.add_tensor(b + "nextn.eh_proj.weight", matrix(n_embd, 2 * n_embd, scale=w))
            writer.add_tensor(b + "nextn.enorm.weight", vector(n_embd))
            writer.add_tensor(b + "nextn.hnorm.weight", vector(n_embd))
            writer.add_tensor(b + "nextn.shared_head_norm.weight", vector(n_embd))


def deepseek32(writer, n_vocab):
    """DeepSeek-V3.2 (conversion/deepseek.py DeepseekV32Model): DeepSeek-V3's shape (deepseek2 above) plus the DSA
    lightning indexer (index_n_heads, index_head_dim 64 = the smallest Hadamard size llama.cpp rotates, index_topk
    below the test prompt's length, so the indexer changes what attention reads) and the MTP block the converter
    appends after the trunk (num_nextn_predict_layers 1)."""
    deepseek2(writer, n_vocab, dsa=dict(index_n_heads=8, index_head_dim=64, index_topk=6))


def deepseek32_wide(writer, n_vocab):
    """deepseek32 above with the indexer's top-k past any context (every cached position read): the same weights,
    so what differs from deepseek32's text is what the top-k left out."""
    deepseek2(writer, n_vocab, dsa=dict(index_n_heads=8, index_head_dim=64, index_topk=4096))


def glm_dsa(writer, n_vocab):
    """GLM-5 / 5.1 (conversion/glm.py GlmMoeDsaModel): the same DSA shape under the glm-dsa architecture (its
    indexer's RoPE is NORM, its LayerNorm has llama.cpp's zero epsilon), no indexer_types (every block has an
    indexer: its context is under 1M), no RoPE scaling, and the appended MTP block."""
    deepseek2(writer, n_vocab, dsa=dict(index_n_heads=8, index_head_dim=64, index_topk=6), yarn=False)


def glm_dsa_shared(writer, n_vocab):
    """GLM-5.2 (conversion/glm.py GlmMoeDsaModel with indexer_types): blocks 0, 1 and 3 with an indexer, block 2
    reusing block 1's top-k."""
    deepseek2(writer, n_vocab, dsa=dict(index_n_heads=8, index_head_dim=64, index_topk=6,
                                        indexer_types=["full", "full", "shared", "full"]), yarn=False)


def deepseek4(writer, n_vocab, hash_layers=1):
    """DeepSeek-V4 / V4-Flash (conversion/deepseek.py DeepseekV4Model), scaled down: hyper-connections (hc_mult 4,
    20 Sinkhorn iterations, hc_eps 1e-6: the residual stream is 4 streams of hidden_size), one shared K=V head of
    head_dim with its last qk_rope_head_dim dims rotated (and rotated back on the output), a q LoRA, per-head attention
    sinks, a sliding window (shorter than the test prompt, so the window changes what is read), the grouped output LoRA
    (o_groups, o_lora_rank), sqrtsoftplus routing with the correction bias, shared experts and the clamped SwiGLU
    (swiglu_limit small enough to bite), the first num_hash_layers blocks routed by the token id (tid2eid, I32).
    compress_ratios as V4's: 0 (the window only), 4 (plus every 4 positions compressed into one row, a lightning indexer
    picking index_topk of them, fewer than the test prompt has) and 128 (plus every 128 positions compressed into one
    row, all of them read)."""
    c = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, num_hidden_layers=4, head_dim=32,
             qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=8,
             num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, num_hash_layers=hash_layers,
             routed_scaling_factor=1.5, norm_topk_prob=True, swiglu_limit=0.3, sliding_window=8, hc_mult=4,
             hc_sinkhorn_iters=20, hc_eps=1e-6, rope_theta=10_000.0, compress_rope_theta=160_000.0,
             rms_norm_eps=1e-6, max_position_embeddings=4096, index_n_heads=4, index_head_dim=64, index_topk=3,
             compress_ratios=[0, 4, 128, 4],
             rope_scaling=dict(type="yarn", factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
                               beta_slow=1.0))
    n_embd, n_head, hd, rope = c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"]
    n_layer, q_lora, groups, o_lora = c["num_hidden_layers"], c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
    hc = c["hc_mult"]
    # TextModel.set_gguf_parameters, then DeepseekV4Model's keys
    writer.add_block_count(n_layer)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(c["rope_theta"])
    # V4's rope_scaling (YaRN), which only its compressed blocks' RoPE reads
    y = c["rope_scaling"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(y["factor"])
    writer.add_rope_scaling_orig_ctx_len(y["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(y["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(y["beta_slow"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(c["n_routed_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SQRTSOFTPLUS)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(n_vocab)
    writer.add_rope_dimension_count(rope)
    writer.add_q_lora_rank(q_lora)
    writer.add_sliding_window(c["sliding_window"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_shared_count(c["n_shared_experts"])
    writer.add_expert_weights_scale(c["routed_scaling_factor"])
    writer.add_expert_weights_norm(c["norm_topk_prob"])
    writer.add_swiglu_clamp_exp([c["swiglu_limit"]] * n_layer)
    writer.add_swiglu_clamp_shexp([c["swiglu_limit"]] * n_layer)
    writer.add_indexer_head_count(c["index_n_heads"])
    writer.add_indexer_key_length(c["index_head_dim"])
    writer.add_indexer_top_k(c["index_topk"])
    writer.add_attention_output_group_count(groups)
    writer.add_attention_output_lora_rank(o_lora)
    writer.add_attention_compress_ratios(c["compress_ratios"])
    writer.add_attention_compress_rope_freq_base(c["compress_rope_theta"])
    writer.add_hyper_connection_count(hc)
    writer.add_hyper_connection_sinkhorn_iterations(c["hc_sinkhorn_iters"])
    writer.add_hyper_connection_epsilon(c["hc_eps"])
    writer.add_hash_layer_count(c["num_hash_layers"])
    writer.add_embedding_length_out(n_embd * hc)

    def f32(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    hc_dim, mix = hc * n_embd, (2 + hc) * hc
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    # the checkpoint keeps the hyper-connection tensors in F32 (tensor_force_quant keeps F32 sources F32)
    writer.add_tensor("output_hc_fn.weight", f32(hc, hc_dim, scale=0.3))
    writer.add_tensor("output_hc_base.weight", f32(hc, scale=0.3))
    writer.add_tensor("output_hc_scale.weight", vector(1, 0.5, 0.1))
    n_exp, n_ff_exp, w = c["n_routed_experts"], c["moe_intermediate_size"], 0.3
    for il in range(n_layer):
        b = f"blk.{il}."
        for kind in ("attn", "ffn"):
            writer.add_tensor(b + f"hc_{kind}_fn.weight", f32(mix, hc_dim, scale=0.3))
            writer.add_tensor(b + f"hc_{kind}_base.weight", f32(mix, scale=0.5))
            writer.add_tensor(b + f"hc_{kind}_scale.weight", vector(3, 0.5, 0.1))
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_sinks.weight", vector(n_head, 0.0, 1.0))
        writer.add_tensor(b + "attn_q_a.weight", matrix(q_lora, n_embd, scale=w))
        writer.add_tensor(b + "attn_q_a_norm.weight", vector(q_lora))
        writer.add_tensor(b + "attn_q_b.weight", matrix(n_head * hd, q_lora, scale=w))
        writer.add_tensor(b + "attn_kv.weight", matrix(hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_kv_a_norm.weight", vector(hd))
        # wo_a as the checkpoint has it: [o_groups x o_lora_rank, n_head x head_dim / o_groups]
        writer.add_tensor(b + "attn_output_a.weight", matrix(groups * o_lora, n_head * hd // groups, scale=w))
        writer.add_tensor(b + "attn_output_b.weight", matrix(n_embd, groups * o_lora, scale=w))
        if c["compress_ratios"][il] == 128:
            writer.add_tensor(b + "attn_compressor_kv.weight", matrix(hd, n_embd, scale=w))
            writer.add_tensor(b + "attn_compressor_gate.weight", matrix(hd, n_embd, scale=w))
            writer.add_tensor(b + "attn_compressor_ape.weight", f32(128, hd, scale=0.5))
            writer.add_tensor(b + "attn_compressor_norm.weight", vector(hd))
        if c["compress_ratios"][il] == 4:
            ih, inh = c["index_head_dim"], c["index_n_heads"]
            writer.add_tensor(b + "attn_compressor_kv.weight", matrix(2 * hd, n_embd, scale=w))
            writer.add_tensor(b + "attn_compressor_gate.weight", matrix(2 * hd, n_embd, scale=w))
            writer.add_tensor(b + "attn_compressor_ape.weight", f32(4, 2 * hd, scale=0.5))
            writer.add_tensor(b + "attn_compressor_norm.weight", vector(hd))
            writer.add_tensor(b + "indexer.proj.weight", matrix(inh, n_embd, scale=w))
            writer.add_tensor(b + "indexer.attn_q_b.weight", matrix(inh * ih, q_lora, scale=w))
            writer.add_tensor(b + "indexer_compressor_kv.weight", matrix(2 * ih, n_embd, scale=w))
            writer.add_tensor(b + "indexer_compressor_gate.weight", matrix(2 * ih, n_embd, scale=w))
            writer.add_tensor(b + "indexer_compressor_ape.weight", f32(4, 2 * ih, scale=0.5))
            writer.add_tensor(b + "indexer_compressor_norm.weight", vector(ih))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate_inp.weight", f32(n_exp, n_embd, scale=0.5))
        if il < c["num_hash_layers"]:
            # each token's experts (distinct), as the checkpoint's tid2eid holds them
            table = np.stack([rng.permutation(n_exp)[: c["num_experts_per_tok"]] for _ in range(n_vocab)])
            writer.add_tensor(b + "ffn_gate_tid2eid.weight", table.astype(np.int32))
        else:
            writer.add_tensor(b + "exp_probs_b.bias", vector(n_exp, 0.0, 0.1))
        writer.add_tensor(b + "ffn_gate_exps.weight", matrix(n_exp, n_ff_exp, n_embd, scale=w))
        writer.add_tensor(b + "ffn_up_exps.weight", matrix(n_exp, n_ff_exp, n_embd, scale=w))
        writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, n_embd, n_ff_exp, scale=w))
        sh = n_ff_exp * c["n_shared_experts"]
        writer.add_tensor(b + "ffn_gate_shexp.weight", matrix(sh, n_embd, scale=w))
        writer.add_tensor(b + "ffn_up_shexp.weight", matrix(sh, n_embd, scale=w))
        writer.add_tensor(b + "ffn_down_shexp.weight", matrix(n_embd, sh, scale=w))


def deepseek4_hash3(writer, n_vocab):
    """deepseek4 above with V4's num_hash_layers 3: blocks 0-2 routed by token id (the first stage must hold them)."""
    deepseek4(writer, n_vocab, hash_layers=3)


def kimi_k3(writer, n_vocab):
    """Kimi K3 (conversion/kimi_k3.py KimiK3Model), scaled down: KDA (linear, recurrent: n_head_kv 0) blocks with an MLA
    block every 4th as linear_attn_config.full_attn_layers lists them (1-indexed), a dense leading block
    (first_k_dense_replace), the latent MoE (routed experts at routed_expert_hidden_size between ffn_routed_down,
    ffn_routed_norm and ffn_routed_up; sigmoid routing with the correction bias, renormalised and scaled; one shared
    expert at full width), the situ activation everywhere (betas small enough to bite), the MLA's sigmoid output gate
    (attn_gate, g_proj on a full-attention block), nope-only MLA (no RoPE; qk_rope_head_dim still sizes K's shared part),
    KDA's full-rank gate (ssm_g), its gate lower bound, the folded -exp(A_log), and the attention residuals: every
    attn_res_block_size-th block (3 here, so blocks 0, 3 and 6 bank checkpoints) banks its input, every block mixes the
    bank, each score vector fused from <x>_res_norm x <x>_res_proj as the converter writes it."""
    c = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=8, intermediate_size=96,
             moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
             first_k_dense_replace=1, routed_scaling_factor=2.5, moe_renormalize=True,
             routed_expert_hidden_size=32, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
             qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-5, max_position_embeddings=4096,
             activation_situ_beta=1.5, activation_situ_linear_beta=2.0, attn_res_block_size=3,
             linear_attn_config=dict(full_attn_layers=[4, 8], short_conv_kernel_size=4, head_dim=16,
                                     gate_lower_bound=-5.0))
    n_embd, n_head, n_layer = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    lin = c["linear_attn_config"]
    hd, d_conv = lin["head_dim"], lin["short_conv_kernel_size"]
    d_inner = hd * n_head
    kv_lora, nope, rope, v_dim = c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"]
    full = [(il + 1) in lin["full_attn_layers"] for il in range(n_layer)]
    # TextModel.set_gguf_parameters, then KimiK3Model's keys
    writer.add_block_count(n_layer)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(c["num_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(n_vocab)
    writer.add_head_count_kv([1 if f else 0 for f in full])
    writer.add_ssm_conv_kernel(d_conv)
    writer.add_kda_head_dim(hd)
    writer.add_kda_gate_lower_bound(lin["gate_lower_bound"])
    writer.add_kv_lora_rank(kv_lora)
    writer.add_rope_dimension_count(rope)
    writer.add_key_length(kv_lora + rope)
    writer.add_value_length(kv_lora)
    writer.add_key_length_mla(nope + rope)
    writer.add_value_length_mla(v_dim)
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_shared_count(c["num_shared_experts"])
    writer.add_leading_dense_block_count(c["first_k_dense_replace"])
    writer.add_expert_weights_scale(c["routed_scaling_factor"])
    writer.add_expert_weights_norm(c["moe_renormalize"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_latent_length(c["routed_expert_hidden_size"])
    writer.add_activation_situ_beta(c["activation_situ_beta"])
    writer.add_activation_situ_linear_beta(c["activation_situ_linear_beta"])
    writer.add_attn_res_block_size(c["attn_res_block_size"])

    def f32(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    w = 0.2
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    # norm x proj, fused by the converter into one F32 vector
    writer.add_tensor("output_res_score.weight", f32(n_embd, scale=0.5))
    n_exp, n_ff_exp, latent = c["num_experts"], c["moe_intermediate_size"], c["routed_expert_hidden_size"]
    for il in range(n_layer):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_res_score.weight", f32(n_embd, scale=0.5))
        writer.add_tensor(b + "ffn_res_score.weight", f32(n_embd, scale=0.5))
        if full[il]:
            writer.add_tensor(b + "attn_q.weight", matrix(n_head * (nope + rope), n_embd, scale=w))
            writer.add_tensor(b + "attn_kv_a_mqa.weight", matrix(kv_lora + rope, n_embd, scale=w))
            writer.add_tensor(b + "attn_kv_a_norm.weight", vector(kv_lora))
            # kv_b split as the converter does: k_b transposed [n_head, kv_lora, nope], v_b [n_head, v, kv_lora]
            writer.add_tensor(b + "attn_k_b.weight", matrix(n_head, kv_lora, nope, scale=w))
            writer.add_tensor(b + "attn_v_b.weight", matrix(n_head, v_dim, kv_lora, scale=w))
            writer.add_tensor(b + "attn_gate.weight", matrix(n_head * v_dim, n_embd, scale=w))
            writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * v_dim, scale=w))
        else:
            for x in ("q", "k", "v"):
                # HF [d_inner, 1, d_conv] reshaped to ggml's [d_conv, 1, d_inner, 1], F32
                writer.add_tensor(b + f"ssm_conv1d_{x}.weight", f32(1, d_inner, 1, d_conv, scale=0.5))
            writer.add_tensor(b + "attn_q.weight", matrix(d_inner, n_embd, scale=w))
            writer.add_tensor(b + "attn_k.weight", matrix(d_inner, n_embd, scale=w))
            writer.add_tensor(b + "attn_v.weight", matrix(d_inner, n_embd, scale=w))
            writer.add_tensor(b + "ssm_f_a.weight", matrix(hd, n_embd, scale=w))
            writer.add_tensor(b + "ssm_f_b.weight", matrix(d_inner, hd, scale=w))
            writer.add_tensor(b + "ssm_beta.weight", matrix(n_head, n_embd, scale=w))
            # -exp(A_log), folded by the converter
            writer.add_tensor(b + "ssm_a", (-np.exp(rng.uniform(0.0, 2.0, n_head))).astype(np.float32))
            writer.add_tensor(b + "ssm_dt.bias", f32(d_inner, scale=0.5))
            writer.add_tensor(b + "ssm_g.weight", matrix(d_inner, n_embd, scale=w))
            writer.add_tensor(b + "ssm_norm.weight", vector(hd))
            writer.add_tensor(b + "attn_output.weight", matrix(n_embd, d_inner, scale=w))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        if il < c["first_k_dense_replace"]:
            n_ff = c["intermediate_size"]
            writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd, scale=w))
            writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd, scale=w))
            writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff, scale=w))
            continue
        writer.add_tensor(b + "ffn_gate_inp.weight", f32(n_exp, n_embd, scale=0.5))
        writer.add_tensor(b + "exp_probs_b.bias", vector(n_exp, 0.0, 0.1))
        writer.add_tensor(b + "ffn_gate_exps.weight", matrix(n_exp, n_ff_exp, latent, scale=w))
        writer.add_tensor(b + "ffn_up_exps.weight", matrix(n_exp, n_ff_exp, latent, scale=w))
        writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, latent, n_ff_exp, scale=w))
        writer.add_tensor(b + "ffn_routed_down.weight", matrix(latent, n_embd, scale=w))
        writer.add_tensor(b + "ffn_routed_norm.weight", vector(latent))
        writer.add_tensor(b + "ffn_routed_up.weight", matrix(n_embd, latent, scale=w))
        sh = n_ff_exp * c["num_shared_experts"]
        writer.add_tensor(b + "ffn_gate_shexp.weight", matrix(sh, n_embd, scale=w))
        writer.add_tensor(b + "ffn_up_shexp.weight", matrix(sh, n_embd, scale=w))
        writer.add_tensor(b + "ffn_down_shexp.weight", matrix(n_embd, sh, scale=w))


def gpt_oss(writer, n_vocab):
    """gpt-oss 20b/120b (conversion/gpt_oss.py GptOssModel): experts in MXFP4 as the checkpoint ships them (repacked,
    not requantised, so F16 everywhere else), biases on q/k/v/o, the router and every expert, attention sinks,
    head_dim apart from hidden / heads, YaRN, a sliding window on alternate blocks (llama.cpp's fixed pattern),
    expert_feed_forward_length = intermediate_size."""
    c = dict(SMALL, head_dim=32, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
             sliding_window=16, rope_theta=150_000.0, max_position_embeddings=512,
             rope=dict(factor=32.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0))
    n_embd, n_head, n_kv, hd, r = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], c["rope"]
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(r["factor"])
    writer.add_rope_scaling_orig_ctx_len(r["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(r["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(r["beta_slow"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_expert_count(c["num_local_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_sliding_window(c["sliding_window"])
    writer.add_expert_feed_forward_length(c["intermediate_size"])

    def mxfp4(*shape):
        data = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.MXFP4)
        return q

    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    n_exp, n_ff, w = c["num_local_experts"], c["intermediate_size"], 0.3
    for il in range(c["num_hidden_layers"]):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        for name, rows in (("attn_q", n_head * hd), ("attn_k", n_kv * hd), ("attn_v", n_kv * hd)):
            writer.add_tensor(b + name + ".weight", matrix(rows, n_embd, scale=w))
            writer.add_tensor(b + name + ".bias", vector(rows, 0.0, 0.1))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd, scale=w))
        writer.add_tensor(b + "attn_output.bias", vector(n_embd, 0.0, 0.1))
        writer.add_tensor(b + "attn_sinks.weight", vector(n_head, 0.0, 1.0))
        writer.add_tensor(b + "post_attention_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate_inp.weight", matrix(n_exp, n_embd, scale=0.5).astype(np.float32))
        writer.add_tensor(b + "ffn_gate_inp.bias", vector(n_exp, 0.0, 0.1))
        for name, shape in (("ffn_gate_exps", (n_exp, n_ff, n_embd)), ("ffn_up_exps", (n_exp, n_ff, n_embd)),
                            ("ffn_down_exps", (n_exp, n_embd, n_ff))):
            writer.add_tensor(b + name + ".weight", mxfp4(*shape), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            writer.add_tensor(b + name + ".bias", vector(shape[0] * shape[1], 0.0, 0.1).reshape(shape[0], shape[1]))


def qwen35(writer, n_vocab, moe=None):
    """Qwen3.5 / 3.6 dense (conversion/qwen.py Qwen3_5TextModel: the MRoPE mixin over Qwen3NextModel's keys), scaled
    down from Qwen3.5-9B: gated DeltaNet blocks with one full-attention block every full_attention_interval, head_dim
    256 with a quarter rotated (rope.dimension_count 64, rope.dimension_sections [11, 11, 10, 0] as the mixin writes
    them), the ssm.* keys, ssm_conv1d in F32, ssm_a = -exp(A_log), and one MTP block after the trunk."""
    c = dict(SMALL, num_attention_heads=2, num_key_value_heads=1, head_dim=256, linear_key_head_dim=32,
             linear_value_head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
             full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=10_000_000.0, rms_norm_eps=1e-6,
             mtp_num_hidden_layers=1)
    n_embd, n_head, n_kv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    trunk = c["num_hidden_layers"]
    n_block = trunk + c["mtp_num_hidden_layers"]
    kd, vd, kh, vh = (c["linear_key_head_dim"], c["linear_value_head_dim"], c["linear_num_key_heads"],
                      c["linear_num_value_heads"])
    conv_dim, value = 2 * kd * kh + vd * vh, vd * vh
    writer.add_block_count(n_block)
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_sections([11, 11, 10, 0])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_key_length(hd)
    writer.add_value_length(hd)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_nextn_predict_layers(c["mtp_num_hidden_layers"])
    writer.add_ssm_conv_kernel(c["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(kd)
    writer.add_ssm_group_count(kh)
    writer.add_ssm_time_step_rank(vh)
    writer.add_ssm_inner_size(value)
    writer.add_full_attention_interval(c["full_attention_interval"])
    writer.add_rope_dimension_count(int(hd * c["partial_rotary_factor"]))
    if moe is not None:
        writer.add_expert_count(moe["num_experts"])
        writer.add_expert_used_count(moe["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(moe["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(moe["shared_expert_intermediate_size"])

    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    n_ff, w = c["intermediate_size"], 0.3
    for il in range(n_block):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "post_attention_norm.weight", vector(n_embd))
        if il < trunk and (il + 1) % c["full_attention_interval"] != 0:
            writer.add_tensor(b + "attn_qkv.weight", matrix(conv_dim, n_embd, scale=w))
            writer.add_tensor(b + "attn_gate.weight", matrix(value, n_embd, scale=w))
            writer.add_tensor(b + "ssm_conv1d.weight", (rng.standard_normal((conv_dim, c["linear_conv_kernel_dim"])) * 0.5).astype(np.float32))
            writer.add_tensor(b + "ssm_dt.bias", vector(vh, 0.0, 0.5))
            writer.add_tensor(b + "ssm_a", -np.exp(vector(vh, 0.0, 0.3)))
            writer.add_tensor(b + "ssm_beta.weight", matrix(vh, n_embd, scale=w))
            writer.add_tensor(b + "ssm_alpha.weight", matrix(vh, n_embd, scale=w))
            writer.add_tensor(b + "ssm_norm.weight", vector(kd))
            writer.add_tensor(b + "ssm_out.weight", matrix(n_embd, value, scale=w))
        else:
            writer.add_tensor(b + "attn_q.weight", matrix(hd * n_head * 2, n_embd, scale=w))
            writer.add_tensor(b + "attn_k.weight", matrix(hd * n_kv, n_embd, scale=w))
            writer.add_tensor(b + "attn_v.weight", matrix(hd * n_kv, n_embd, scale=w))
            writer.add_tensor(b + "attn_q_norm.weight", vector(hd))
            writer.add_tensor(b + "attn_k_norm.weight", vector(hd))
            writer.add_tensor(b + "attn_output.weight", matrix(n_embd, hd * n_head, scale=w))
        if moe is None:
            writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd, scale=w))
            writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd, scale=w))
            writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff, scale=w))
        else:
            n_exp, n_ff_exp, sh = moe["num_experts"], moe["moe_intermediate_size"], moe["shared_expert_intermediate_size"]
            writer.add_tensor(b + "ffn_gate_inp.weight", (rng.standard_normal((n_exp, n_embd)) * 0.5).astype(np.float32))
            experts_gate_up(writer, b, n_exp, n_ff_exp, n_embd, w)
            writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, n_embd, n_ff_exp, scale=w))
            writer.add_tensor(b + "ffn_gate_inp_shexp.weight", vector(n_embd, 0.0, 0.3))
            writer.add_tensor(b + "ffn_gate_shexp.weight", matrix(sh, n_embd, scale=w))
            writer.add_tensor(b + "ffn_up_shexp.weight", matrix(sh, n_embd, scale=w))
            writer.add_tensor(b + "ffn_down_shexp.weight", matrix(n_embd, sh, scale=w))
        if il >= trunk:
            writer.add_tensor(b + "nextn.eh_proj.weight", matrix(n_embd, 2 * n_embd))
            writer.add_tensor(b + "nextn.enorm.weight", vector(n_embd))
            writer.add_tensor(b + "nextn.hnorm.weight", vector(n_embd))
            writer.add_tensor(b + "nextn.shared_head_norm.weight", vector(n_embd))


def qwen35moe(writer, n_vocab):
    """Qwen3.5 / 3.6 MoE (Qwen3_5MoeTextModel, e.g. Qwen3.5-35B-A3B): qwen35's hybrid stack with routed experts
    (softmax, top-k renormalised by the graph), expert_feed_forward_length and expert_shared_feed_forward_length, and a
    sigmoid-gated shared expert (ffn_gate_inp_shexp)."""
    qwen35(writer, n_vocab, moe=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                     shared_expert_intermediate_size=32))


def minimax_m2(writer, n_vocab):
    """MiniMax-M2 / M2.5 (conversion/minimax.py MiniMaxM2Model), scaled down: head_dim 128 apart from hidden / heads
    (key_length), rotary_dim 64 (rope.dimension_count half the head), q/k norms over the whole projection
    (qk_norm_type per_layer: attn_q_norm [heads x head_dim]), every block routed, scoring_func sigmoid written as
    expert_gating_func, the routing bias (e_score_correction_bias as exp_probs_b.bias), expert_feed_forward_length from
    intermediate_size (written as feed_forward_length too), the experts stacked from w1/w2/w3, an untied output."""
    n_layer, n_embd, n_head, n_kv, hd, n_rot = 4, 64, 4, 2, 32, 16
    n_exp, n_used, n_ff = 8, 2, 32
    writer.add_block_count(n_layer)
    writer.add_context_length(4096)
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
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    w = 0.3
    for il in range(n_layer):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_k.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_v.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_q_norm.weight", vector(n_head * hd))
        writer.add_tensor(b + "attn_k_norm.weight", vector(n_kv * hd))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd, scale=w))
        writer.add_tensor(b + "ffn_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate_inp.weight", matrix(n_exp, n_embd, scale=0.5).astype(np.float32))
        writer.add_tensor(b + "exp_probs_b.bias", vector(n_exp, around=0.0, spread=0.3))
        experts_gate_up(writer, b, n_exp, n_ff, n_embd, w)
        writer.add_tensor(b + "ffn_down_exps.weight", matrix(n_exp, n_embd, n_ff, scale=w))


def olmo2(writer, n_vocab, olmo3=False):
    """OLMo 2 (conversion/olmo.py Olmo2Model, TextModel's keys): no attn_norm / ffn_norm, q/k norms over the whole
    projection (attn_q_norm [hidden], attn_k_norm [kv heads x head]), attn_post_norm and ffn_post_norm, an untied
    output, no rope.dimension_count. OLMo 3 (the same class): sliding_window written, and sliding_window_pattern as one
    bool per block from layer_types (three sliding, one full)."""
    n_layer, n_embd, n_head, n_kv, n_ff = 4, 64, 4, 2, 128
    hd = n_embd // n_head
    writer.add_block_count(n_layer)
    writer.add_context_length(4096)
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(500_000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    if olmo3:
        writer.add_sliding_window(16)
        writer.add_sliding_window_pattern([(i + 1) % 4 != 0 for i in range(n_layer)])
    writer.add_tensor("token_embd.weight", matrix(n_vocab, n_embd, scale=0.5))
    writer.add_tensor("output_norm.weight", vector(n_embd))
    writer.add_tensor("output.weight", matrix(n_vocab, n_embd, scale=0.3))
    w = 0.3
    for il in range(n_layer):
        b = f"blk.{il}."
        writer.add_tensor(b + "attn_q.weight", matrix(n_head * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_k.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_v.weight", matrix(n_kv * hd, n_embd, scale=w))
        writer.add_tensor(b + "attn_q_norm.weight", vector(n_head * hd))
        writer.add_tensor(b + "attn_k_norm.weight", vector(n_kv * hd))
        writer.add_tensor(b + "attn_output.weight", matrix(n_embd, n_head * hd, scale=w))
        writer.add_tensor(b + "post_attention_norm.weight", vector(n_embd))
        writer.add_tensor(b + "ffn_gate.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_up.weight", matrix(n_ff, n_embd, scale=w))
        writer.add_tensor(b + "ffn_down.weight", matrix(n_embd, n_ff, scale=w))
        writer.add_tensor(b + "post_ffw_norm.weight", vector(n_embd))


def olmo3(writer, n_vocab):
    olmo2(writer, n_vocab, olmo3=True)


FAMILIES = {
    "olmo2": ("olmo2", olmo2),
    "olmo3": ("olmo2", olmo3),
    "qwen35moe": ("qwen35moe", qwen35moe),
    "qwen35": ("qwen35", qwen35),
    "gpt-oss": ("gpt-oss", gpt_oss),
    "deepseek2": ("deepseek2", deepseek2),
    "deepseek32": ("deepseek32", deepseek32),
    "deepseek32-wide": ("deepseek32", deepseek32_wide),
    "glm-dsa": ("glm-dsa", glm_dsa),
    "glm-dsa-shared": ("glm-dsa", glm_dsa_shared),
    "deepseek4": ("deepseek4", deepseek4),
    "deepseek4-hash3": ("deepseek4", deepseek4_hash3),
    "kimi-k3": ("kimi-k3", kimi_k3),
    "mistral3": ("mistral3", mistral3),
    "gemma3": ("gemma3", gemma3),
    "gemma4": ("gemma4", gemma4),
    "gemma4-moe": ("gemma4", gemma4_moe),
    "gemma4-e2b": ("gemma4", gemma4_e2b),
    "minimax-m2": ("minimax-m2", minimax_m2),
    "qwen3moe": ("qwen3moe", qwen3moe),
    "glm4moe": ("glm4moe", glm4moe),
    "llama": ("llama", llama),
    "qwen2": ("qwen2", qwen2),
    "qwen3": ("qwen3", qwen3),
}

if family not in FAMILIES:
    sys.exit(f"unknown family {family!r} (known: {', '.join(sorted(FAMILIES))})")
arch, write = FAMILIES[family]
writer = gguf.GGUFWriter(out_path, arch, split_max_tensors=split.get("maxTensors", 0),
                         small_first_shard=split.get("smallFirst", False))
cuts = set(split.get("cuts", []))
if cuts:
    plain_add = writer.add_tensor

    def add_tensor(name, tensor, *args, **kwargs):
        # a new part starts at each cut (gguf-py's writer starts one the same way when a part is full)
        if name in cuts and len(writer.tensors[-1]) > 0:
            writer.tensors.append({})
        plain_add(name, tensor, *args, **kwargs)

    writer.add_tensor = add_tensor
if Q8:
    f16_add = writer.add_tensor

    def add_q8(name, tensor, *args, **kwargs):
        if tensor.dtype == np.float16 and tensor.ndim >= 2 and tensor.shape[-1] % 32 == 0:
            q = gguf.quants.quantize(tensor.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
            return f16_add(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return f16_add(name, tensor, *args, **kwargs)

    writer.add_tensor = add_q8
writer.add_name(f"converted-{family}")
vocab = copy_tokenizer(writer, tokenizer_path)
write(writer, vocab)
writer.write_header_to_file()
writer.write_kv_data_to_file()
writer.write_tensors_to_file()
writer.close()
