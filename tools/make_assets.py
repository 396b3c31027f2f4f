"""Generate the offline assets of the CPU debug jobs (deterministic; the outputs are committed).

* ``torchtitan_ext/assets/text/corpus.jsonl``: a few thousand short synthetic documents from a
  small grammar (nothing is downloaded, so nothing can be fetched at run time either);
* ``torchtitan_ext/assets/tokenizer/``: a byte-level BPE tokenizer (2,000 tokens, fits the
  debug flavors' 2,048-entry vocabularies) trained on that corpus with ``tokenizers``.

    python tools/make_assets.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "torchtitan_ext" / "assets"
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"

SUBJECTS = ["the model", "a gradient", "the optimizer", "every block", "the planner", "a tensor",
            "the scheduler", "each rank", "the loss", "an activation", "the compiler", "a kernel",
            "the cluster", "our team", "the tokenizer", "a batch", "the memory", "the network"]
VERBS = ["keeps", "recomputes", "reads", "writes", "measures", "saves", "shards", "gathers",
         "reduces", "schedules", "frees", "replays", "trains", "checks", "plans", "streams"]
OBJECTS = ["the weights", "a checkpoint", "the activations", "every value", "the frontier",
           "a small budget", "the peak", "its inputs", "the gradients", "one storage", "the tape",
           "a random mask", "the attention scores", "the hidden state", "the router logits"]
ADVERBS = ["quickly", "exactly", "twice", "once", "lazily", "carefully", "in place", "on time",
           "without a copy", "under the limit", "per step", "per layer", "in parallel"]
CONNECT = ["and then", "while", "because", "so that", "before", "after", "although", "until"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    if rng.random() < 0.6:
        s += f" {rng.choice(ADVERBS)}"
    if rng.random() < 0.4:
        s += f" {rng.choice(CONNECT)} {rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}"
    n = rng.randint(0, 999)
    if rng.random() < 0.2:
        s += f" {n} times"
    return s[0].upper() + s[1:] + rng.choice([".", ".", ".", "!", "?"])


def corpus(n_docs: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(sentence(rng) for _ in range(rng.randint(3, 12))) for _ in range(n_docs)]


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    docs = corpus()
    text_dir = ROOT / "text"
    text_dir.mkdir(parents=True, exist_ok=True)
    with open(text_dir / "corpus.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=[BOS, EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok_dir = ROOT / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True, "add_eos_token": False,
         "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1))
    print(f"wrote {len(docs)} documents and a {tok.get_vocab_size()}-token tokenizer under {ROOT}")


if __name__ == "__main__":
    main()
