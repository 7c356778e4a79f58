"""Write a llama model of random weights as GGUF, for llama.cpp (run with the cache venv's Python, which has gguf).

    tiny_llama.py OUT.gguf --embd 64 --ff 128 --layers 2 --seed 1 [--f16]

The vocabulary is tiny and printable: the three special tokens, SentencePiece's word marker and lowercase letters,
and a few words; the output weights of the special tokens are zero, so that greedy decoding (where every other
token's logit is random) never ends the text early. gguf and numpy are imported by name, so that this file
type-checks where they are not installed (the repository's own venv).
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

SPECIAL = ["<unk>", "<s>", "</s>"]
WORDS = ["\u2581" + word for word in ("the", "slice", "gpu", "memory", "layer", "hello", "world")]
VOCAB = [*SPECIAL, "\u2581", *"abcdefghijklmnopqrstuvwxyz", *WORDS]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--ff", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--f16", action="store_true", help="weights as F16 (norms stay F32)")
    args = parser.parse_args()
    gguf = importlib.import_module("gguf")
    np = importlib.import_module("numpy")
    rng = np.random.default_rng(args.seed)
    weights = np.float16 if args.f16 else np.float32

    def matrix(rows: int, columns: int) -> Any:
        # numpy's shape is GGUF's dimensions reversed: (rows, columns) is ne = [columns, rows].
        return (rng.standard_normal((rows, columns), dtype=np.float32) / np.sqrt(columns)).astype(weights)

    def ones(size: int) -> Any:
        return np.ones(size, dtype=np.float32)

    writer = gguf.GGUFWriter(args.out, "llama")
    writer.add_name("gpuppetti tiny llama")
    writer.add_context_length(256)
    writer.add_embedding_length(args.embd)
    writer.add_block_count(args.layers)
    writer.add_feed_forward_length(args.ff)
    writer.add_head_count(args.heads)
    writer.add_head_count_kv(args.heads)
    writer.add_rope_dimension_count(args.embd // args.heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(1 if args.f16 else 0)
    writer.add_vocab_size(len(VOCAB))
    writer.add_tokenizer_model("llama")
    writer.add_token_list(VOCAB)
    writer.add_token_scores([0.0] * len(SPECIAL) + [-float(index) for index in range(len(VOCAB) - len(SPECIAL))])
    types = gguf.TokenType
    writer.add_token_types([types.UNKNOWN, types.CONTROL, types.CONTROL] + [types.NORMAL] * (len(VOCAB) - 3))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)

    output = matrix(len(VOCAB), args.embd)
    output[: len(SPECIAL)] = 0
    writer.add_tensor("token_embd.weight", matrix(len(VOCAB), args.embd))
    writer.add_tensor("output_norm.weight", ones(args.embd))
    writer.add_tensor("output.weight", output)
    for block in range(args.layers):
        prefix = f"blk.{block}."
        writer.add_tensor(prefix + "attn_norm.weight", ones(args.embd))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(prefix + name + ".weight", matrix(args.embd, args.embd))
        writer.add_tensor(prefix + "ffn_norm.weight", ones(args.embd))
        writer.add_tensor(prefix + "ffn_gate.weight", matrix(args.ff, args.embd))
        writer.add_tensor(prefix + "ffn_up.weight", matrix(args.ff, args.embd))
        writer.add_tensor(prefix + "ffn_down.weight", matrix(args.embd, args.ff))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
