from transformers import AutoTokenizer

from vlfit.models.tokenizer import train_caption_tokenizer

CAPTIONS = [
    "two red circles on the left and one blue square at the top.",
    "one green cross in the center.",
    "three yellow triangles at the bottom and two purple squares on the right.",
] * 20


def test_uses_roberta_special_ids_and_wraps_sequences():
    tok = train_caption_tokenizer(CAPTIONS, vocab_size=512)
    assert (tok.bos_token_id, tok.pad_token_id, tok.eos_token_id) == (0, 1, 2)
    ids = tok("two red circles").input_ids
    assert ids[0] == 0 and ids[-1] == 2
    assert len(tok) <= 512


def test_round_trips_through_save_pretrained(tmp_path):
    tok = train_caption_tokenizer(CAPTIONS, vocab_size=512)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "one blue square at the top."
    assert loaded(text).input_ids == tok(text).input_ids
    assert loaded.decode(loaded(text).input_ids, skip_special_tokens=True).strip() == text


def test_unseen_characters_never_map_to_unknown():
    tok = train_caption_tokenizer(CAPTIONS, vocab_size=512)
    ids = tok("naïve café ☃").input_ids
    assert tok.unk_token_id not in ids


def test_empty_captions_are_ignored_but_all_empty_is_an_error():
    tok = train_caption_tokenizer(["", None, *CAPTIONS], vocab_size=512)
    assert len(tok("red").input_ids) > 2
    import pytest

    with pytest.raises(ValueError, match="caption"):
        train_caption_tokenizer(["", "  ", None], vocab_size=512)


def test_the_input_spec_tokenizes_captions_as_every_site_did():
    from vlfit.models.family import InputSpec
    from vlfit.models.loading import with_attention_mask

    tok = with_attention_mask(train_caption_tokenizer(CAPTIONS, vocab_size=512))
    spec = InputSpec(32, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), tok, max_seq_length=16)
    texts = [CAPTIONS[0] * 3, "one green cross."]
    tokens = spec.tokenize(texts)
    expected = tok(texts, max_length=16, truncation=True, padding="longest", return_tensors="pt")
    assert set(tokens) == {"input_ids", "attention_mask"}
    assert tokens["input_ids"].tolist() == expected["input_ids"].tolist() and tokens["input_ids"].shape[1] == 16
    assert tokens["attention_mask"].tolist() == expected["attention_mask"].tolist()
    short = spec.tokenize(["one green cross."], multiple_of_8=True)  # training batches: a multiple of 8 tokens
    assert short["input_ids"].shape[1] == 8 and short["attention_mask"][0].sum() < 8
    assert spec.tokenize(["one green cross."])["input_ids"].shape[1] < 8  # elsewhere the longest caption's length


def test_training_prints_nothing(capfd):
    """The tokenizers trainer's progress wrote three blank lines on stdout (fd 1, from Rust) at each preset load."""
    train_caption_tokenizer(CAPTIONS, vocab_size=512)
    assert capfd.readouterr().out == ""
