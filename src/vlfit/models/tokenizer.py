"""An offline tokenizer for presets: a RoBERTa-style byte-level BPE trained on the training captions.

Presets have no pretrained tokenizer to download, so vlfit trains one (a few seconds for thousands of captions)
and saves it beside the model. It uses RoBERTa's special tokens and ids (``<s>``=0, ``<pad>``=1, ``</s>``=2,
``<unk>``=3, ``<mask>``=4), which BridgeTower's text config expects, and wraps sequences as ``<s> ... </s>``.
Byte-level BPE never fails on unseen characters, so captions outside the training set still tokenize.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import ByteLevelBPETokenizer
from tokenizers.processors import RobertaProcessing
from transformers import PreTrainedTokenizerFast

from vlfit.errors import ConfigError

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")


def train_caption_tokenizer(
    captions: Iterable[str | None],
    vocab_size: int,
    model_max_length: int = 128,
    special_tokens: Sequence[str] = SPECIAL_TOKENS,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on ``captions`` and wrap it as a transformers tokenizer.

    Args:
        captions: Training captions; ``None`` and empty ones are ignored.
        vocab_size: Upper bound on the vocabulary (the model's embedding table must be at least this large).
        model_max_length: Longest sequence the tokenizer produces when truncating.
        special_tokens: ``SPECIAL_TOKENS`` in the order that gives their ids (a family whose model reads meaning
            into an id, as CLIP's text tower does into ``eos_token_id == 2``, reorders them).

    Returns:
        A fast tokenizer that can be saved with ``save_pretrained`` and reloaded with ``AutoTokenizer``.
    """
    if sorted(special_tokens) != sorted(SPECIAL_TOKENS):
        raise ValueError(f"special_tokens must order {SPECIAL_TOKENS}, got {tuple(special_tokens)}")
    texts = [c for c in captions if c and c.strip()]
    if not texts:
        raise ConfigError("cannot train a tokenizer: every caption is empty; check --caption_column")
    bpe = ByteLevelBPETokenizer(add_prefix_space=True)
    # No progress: the trainer's bars are drawn on stdout (three blank lines when it is not a terminal).
    bpe.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=list(special_tokens), show_progress=False
    )
    bpe._tokenizer.post_processor = RobertaProcessing(
        ("</s>", bpe.token_to_id("</s>")), ("<s>", bpe.token_to_id("<s>")), add_prefix_space=True
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<unk>",
        mask_token="<mask>",
        cls_token="<s>",
        sep_token="</s>",
        model_max_length=model_max_length,
    )
