"""Captions longer than a text tower's positions: ``vlfit train --max_seq_length N`` stretches a CLIP or SigLIP
tower's position table the Long-CLIP way; the run saves N positions that plain transformers loads whole and every
door reads; ``vlfit make-data --caption_grammar long`` writes captions that differ only past token 77."""

from __future__ import annotations

import pytest
import torch

from vlfit.data.synthetic import SyntheticConfig, make_dataset
from vlfit.data.synthetic.scenes import LONG_PREAMBLE, parse_caption
from vlfit.errors import ConfigError
from vlfit.models.loading import build_model, resolve_model
from vlfit.models.long_captions import KEPT_POSITIONS, stretched_table

LONG = [LONG_PREAMBLE + tail for tail in ("one red circle on the left.", "two blue squares at the top.")]


def test_the_first_positions_are_kept_and_the_rest_interpolated():
    table = torch.arange(77 * 2, dtype=torch.float32).reshape(77, 2)
    stretched = stretched_table(table, 248)
    assert stretched.shape == (248, 2)
    torch.testing.assert_close(stretched[:KEPT_POSITIONS], table[:KEPT_POSITIONS])
    torch.testing.assert_close(stretched[-1], table[-1])  # the ends of the stretched part are the old ends
    torch.testing.assert_close(stretched[KEPT_POSITIONS], table[KEPT_POSITIONS])
    steps = stretched[KEPT_POSITIONS + 1 :, 0] - stretched[KEPT_POSITIONS:-1, 0]  # linear: equal steps
    torch.testing.assert_close(steps, torch.full_like(steps, steps[0].item()), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("preset", ["clip-tiny", "siglip-tiny"])
def test_a_training_run_stretches_the_tower_so_the_words_past_its_positions_count(preset):
    spec = resolve_model(model_preset=preset, captions=lambda: LONG * 8, max_seq_length=160, stretch_text=True)
    model = build_model(spec)
    tokens = spec.inputs.tokenize(LONG)
    assert spec.inputs.max_seq_length == 160 and tokens["input_ids"].shape[1] > 100
    assert spec.family.max_text_length(model.config) == spec.family.max_text_length(spec.config) == 160
    with torch.no_grad():
        first, second = spec.family.encode_text(model, **tokens)
    assert torch.dot(first, second).item() < 0.9999  # they differ only in their last words
    cut = resolve_model(model_preset=preset, captions=lambda: LONG * 8, max_seq_length=160)  # another command
    assert cut.inputs.max_seq_length == spec.family.max_text_length(cut.config) < 100


def test_a_tower_that_cannot_be_stretched_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^--max_seq_length 600 is longer than the 128 text positions of "):
        resolve_model(model_preset="two-tower-tiny", captions=lambda: LONG, max_seq_length=600, stretch_text=True)


def test_long_captions_share_their_first_hundred_words():
    data = make_dataset(SyntheticConfig(num_samples=12, seed=1, min_long_side=64, max_long_side=96,
                                        caption_grammar="long"))  # fmt: skip
    captions = data["train"]["image_description"]
    assert all(text.startswith(LONG_PREAMBLE) for text in captions) and len(LONG_PREAMBLE.split()) > 90
    assert len(set(captions)) > 1
    assert [parse_caption(text) for text in captions]  # each names its scene after the shared words


@pytest.mark.slow
def test_a_stretched_run_loads_whole_in_plain_transformers_and_at_its_length_through_every_door(tmp_path):
    from transformers import CLIPModel

    import vlfit
    from tests.training.train_runs import single_torch_thread, tiny_train_argv
    from vlfit.cli import main
    from vlfit.data.synthetic import save_dataset

    config = SyntheticConfig(num_samples=40, seed=2, min_long_side=64, max_long_side=96, caption_grammar="long")
    save_dataset(make_dataset(config), str(tmp_path / "data"), format="arrow")
    argv = tiny_train_argv(str(tmp_path / "data"), tmp_path / "run", "--max_seq_length", "150", "--save_strategy",
                           "no", steps=2)  # fmt: skip
    argv[argv.index("tiny")] = "clip-tiny"
    with single_torch_thread():
        assert main(["train", *argv]) == 0
    plain, info = CLIPModel.from_pretrained(tmp_path / "run", output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert plain.config.text_config.max_position_embeddings == 150
    loaded = vlfit.load(str(tmp_path / "run"))
    assert loaded.max_seq_length == 150
    first, second = loaded.encode_texts(LONG)
    assert float(first @ second) < 0.9999
