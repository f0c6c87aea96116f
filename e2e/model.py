"""The tiny model of the end-to-end run: a random-weight Llama and a tokenizer trained here.

Nothing is downloaded.  The tokenizer is a WordLevel model trained with `tokenizers` on text made
from a fixed word list, so every word of a prompt is one token and prompts have exact lengths;
the model's weights come from a fixed seed, so every build of the same spec is the same model.
`build(dir, spec)` is idempotent: a directory holding the spec it asks for is kept as it is.

    python -m e2e.model DIR [--layers N --hidden H]
"""
from __future__ import annotations

import argparse
import json
import os
import random
from dataclasses import asdict, dataclass

WORDS = 400          # the word list's size; the vocabulary adds the special tokens
SPECIALS = ["<unk>", "<s>", "</s>", "<pad>"]


@dataclass(frozen=True)
class Spec:
    layers: int = 2
    hidden: int = 128
    heads: int = 4
    kv_heads: int = 2          # GQA, so the KV layout differs from the query layout
    intermediate: int = 256
    max_positions: int = 4096
    seed: int = 24
    # Larger than Llama's 0.02: random weights that small give nearly flat logits, and greedy
    # decoding over near-ties would turn on float rounding rather than on the KV it was given.
    init_range: float = 0.15


def words() -> list[str]:
    rng = random.Random(7)
    letters = "abcdefghijklmnopqrstuvwxyz"
    out: set[str] = set()
    while len(out) < WORDS:
        out.add("".join(rng.choice(letters) for _ in range(rng.randint(3, 7))))
    return sorted(out)


def build(path: str, spec: Spec = Spec()) -> str:
    stamp = os.path.join(path, "e2e-spec.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == asdict(spec):
                return path
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    vocab = words()
    rng = random.Random(11)
    corpus = [" ".join(rng.choice(vocab) for _ in range(64)) for _ in range(200)]
    corpus.append(" ".join(vocab))  # every word seen at least once: no <unk> in any prompt
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIALS))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(path)

    torch.manual_seed(spec.seed)
    config = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=spec.hidden,
        intermediate_size=spec.intermediate, num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions, initializer_range=spec.init_range,
        bos_token_id=fast.bos_token_id, eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id, tie_word_embeddings=False, torch_dtype="float32")
    model = LlamaForCausalLM(config).to(torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    with open(stamp, "w") as f:
        json.dump(asdict(spec), f)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--layers", type=int, default=Spec.layers)
    ap.add_argument("--hidden", type=int, default=Spec.hidden)
    a = ap.parse_args()
    heads = max(4, a.hidden // 64)  # head size 64 at most: a size the CPU backend supports
    spec = Spec(layers=a.layers, hidden=a.hidden, heads=heads, kv_heads=max(2, heads // 4),
                intermediate=2 * a.hidden)
    print(build(a.path, spec))


if __name__ == "__main__":
    main()
