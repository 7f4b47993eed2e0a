"""A byte-level BPE tokenizer trained on the spot on a fixed synthetic corpus (no downloads)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]

# ChatML: the same template the router / benchmarks will send through /v1/chat/completions
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_WORDS = (
    "the a of and to in is was for on that with as by at from it this be are or an which not have "
    "prefill decode cache block key value token model server request layer attention transfer store "
    "memory router proxy latency throughput batch sequence prompt output vector tensor kernel "
    "hello world question answer system user assistant time data network fast slow small large "
    "one two three four five six seven eight nine ten hundred thousand first last next "
    "red green blue cat dog house tree river city story write read tell explain why how what when"
).split()


def synthetic_corpus(lines: int = 3000) -> list[str]:
    """Deterministic text: fixed seed, fixed word list, digits, punctuation and code-ish lines."""
    rng = random.Random(1234)
    out: list[str] = []
    for i in range(lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if i % 3 == 0:
            words[0] = words[0].capitalize()
        if i % 5 == 0:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 99999)))
        line = " ".join(words) + rng.choice([".", "?", "!", ",", ":"])
        if i % 7 == 0:
            line = f"def f{i}(x):\n    return x * {rng.randint(1, 9)} + {rng.random():.3f}"
        out.append(line)
    return out


def train_tokenizer(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def write_tokenizer(tok: Tokenizer, model_dir: Path, max_length: int) -> None:
    tok.save(str(model_dir / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "chat_template": CHAT_TEMPLATE,
    }
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    special_map = {
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    }
    (model_dir / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
