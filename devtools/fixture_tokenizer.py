"""The tiny byte-level BPE tokenizer (trained on a built-in corpus) and the chat template every
test checkpoint carries."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .families import write_json

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)
BOS_TOKEN = ENDOFTEXT
EOS_TOKEN = IM_END
PAD_TOKEN = ENDOFTEXT
TARGET_VOCAB_SIZE = 512
GGUF_TOKENIZER_PRE = "qwen2"

# Qwen2's split regex. llama.cpp runs the same one for tokenizer.ggml.pre == "qwen2", so text
# tokenises identically through tokenizer.json and through the GGUF.
QWEN2_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- if messages and messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


CORPUS = """\
The lighthouse keeper woke before dawn, as he had done every morning for thirty years. He climbed
the spiral stairs, counted the steps out of habit, and checked the lamp. The sea was calm and grey,
and the gulls were already arguing over the harbour. In the small kitchen below, the kettle began to
sing, and the radio spoke quietly about the weather: light winds from the west, rain by the evening.

A user asked the assistant a simple question about the system. The assistant answered that the
system was running normally, that every service had started on time, and that the logs showed no
errors. The user thanked the assistant and asked for a summary of the morning. The assistant wrote
three short sentences and then stopped, because a good answer is often a short one.

Numbers matter in small tests: 1, 2, 3, 10, 42, 100, 256, 512, 1024 and 2048 appear here so that
digits are seen during training. Dates such as 2024-01-15 and times such as 09:30 and 17:45 are also
common. Prices like $3.50 or 12.99 euros, and ratios like 3:2 or 16:9, show up in everyday writing.

The village market opened at eight. Farmers brought apples, pears, potatoes, onions and fresh bread.
Children ran between the stalls while their parents talked about the harvest, the price of grain and
the new road that would connect the village to the city. Nobody was in a hurry; the day was long and
the sun was warm, and there would be time enough for everything that needed to be done.

Engineers who build inference servers care about latency, throughput and correctness. They measure
the time to the first token, the number of tokens generated per second, and whether the output of
the model matches a trusted reference. When the numbers disagree, they read the code again, slowly,
and look for the one line where the order of the heads, the scale of the rotary embedding, or the
shape of a weight matrix was not what they expected.

Quiet rivers flow through green valleys toward the open sea. Along the banks, tall trees lean over
the water, and their leaves turn gold and red in autumn. In winter, the river freezes at the edges,
and in spring it rises with melted snow from the mountains. Summer brings swimmers, boats and long
evenings of light.
"""


def build_tokenizer() -> Any:
    """A byte-level BPE tokenizer trained on the built-in corpus; the specials get the last ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TARGET_VOCAB_SIZE - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS])
    return tokenizer


def write_tokenizer(out: Path, tokenizer: Any, config: dict[str, Any]) -> None:
    tokenizer.save(str(out / "tokenizer.json"))
    added = {
        str(tokenizer.token_to_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS_TOKEN,
        "errors": "replace",
        "model_max_length": config["max_position_embeddings"],
        "pad_token": PAD_TOKEN,
        # PreTrainedTokenizerFast here makes transformers drop the GGUF's special tokens and chat
        # template when a GGUF in this directory is loaded with AutoTokenizer(..., gguf_file=...).
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    write_json(out / "tokenizer_config.json", tokenizer_config)


# ---------------------------------------------------------------------------------------------
# GGUF

