"""A Llama-architecture PyTorch decoder written as a GGUF file (llama.cpp's format), so that llama.cpp runs the
same weights our stages run. The gguf package (llama.cpp's own Python writer) does the format; this module maps
the transformers LlamaForCausalLM state to llama.cpp's tensor names and metadata, as llama.cpp's
convert_hf_to_gguf.py does for the llama architecture: q and k projections permuted from the rotate-half layout
transformers uses to the interleaved pairs llama.cpp's rope reads, norms in FP32.

convert_hf_to_gguf.py itself needs the model's tokenizer files, which a model built from a config (random weights
at a real shape) does not have, so the vocabulary written here is a placeholder SentencePiece-style one of the
model's size (3 control tokens, the 256 byte tokens, then `t<i>`): generation by token ids, which is what both
sides are timed on, does not read it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from optimizer.core.errors import OptimizerError


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' rotate-half q/k rows -> llama.cpp's interleaved pairs (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama_tensors(model: Any) -> dict[str, np.ndarray]:
    """llama.cpp name -> FP32 array for a transformers LlamaForCausalLM."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads or cfg.num_attention_heads
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": state["model.embed_tokens.weight"], "output_norm.weight": state["model.norm.weight"],
           "output.weight": state.get("lm_head.weight", state["model.embed_tokens.weight"])}
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(cfg.num_hidden_layers):
        for hf, ours in names.items():
            w = state[f"model.layers.{i}.{hf}.weight"]
            if ours == "attn_q":
                w = _permute(w, heads)
            elif ours == "attn_k":
                w = _permute(w, kv_heads)
            out[f"blk.{i}.{ours}.weight"] = w
    return out


def write_llama_gguf(model: Any, path: Path) -> Path:
    """The model as an FP32 GGUF at `path` (quantized types are made from it by llama.cpp's quantizer)."""
    import gguf

    cfg = model.config
    if getattr(cfg, "model_type", None) != "llama":
        raise OptimizerError(f"GGUF: only the llama architecture is written here, not {cfg.model_type!r}")
    if getattr(cfg, "attention_bias", False) or getattr(cfg, "mlp_bias", False):
        raise OptimizerError("GGUF: a llama with biases is not written here")
    writer = gguf.GGUFWriter(str(path), "llama")
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer.add_name("optimizer-export")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(cfg.num_key_value_heads or heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or
                                    (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    tokens, types = _placeholder_vocab(cfg.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_types(types)
    writer.add_bos_token_id(int(cfg.bos_token_id if cfg.bos_token_id is not None else 1))
    writer.add_eos_token_id(int(cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else 2))
    writer.add_unk_token_id(0)
    for name, array in llama_tensors(model).items():
        writer.add_tensor(name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _placeholder_vocab(size: int) -> tuple[list[bytes], list[int]]:
    import gguf

    if size < 259:
        raise OptimizerError(f"GGUF: a vocabulary of {size} is smaller than the 259 control and byte tokens")
    tokens = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    tokens += [f"t{i}".encode() for i in range(len(tokens), size)]
    types += [gguf.TokenType.NORMAL] * (size - len(types))
    return tokens, [int(t) for t in types]


# llama.cpp's quantization types by name -> its llama_ftype value (llama.h)
FTYPES = {"F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18}


def quantize_gguf(src: Path, dst: Path, kind: str, threads: int) -> Path:
    """llama.cpp's own quantizer (llama_model_quantize, through llama-cpp-python) from the FP32 GGUF."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[kind]
    params.nthread = threads
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise OptimizerError(f"llama.cpp could not quantize {src} to {kind} (code {rc})")
    return dst
