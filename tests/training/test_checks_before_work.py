"""Mistakes in the data are refused when the splits open, before a tokenizer is trained or a model built."""

import io

import datasets
import pytest
from PIL import Image

import vlfit.models.config_and_processors
from vlfit.cli import main


@pytest.fixture
def no_tokenizer_training(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a tokenizer was trained before the data was checked")

    monkeypatch.setattr(vlfit.models.config_and_processors, "train_caption_tokenizer", refuse)


def _train(tmp_path, *flags: str) -> list[str]:
    return ["train", "--model_preset", "tiny", "--output_dir", str(tmp_path / "run"), "--max_steps", "1",
            "--report_to", "none", *flags]  # fmt: skip


def test_an_image_column_of_captions_is_refused_before_a_tokenizer_is_trained(
    tmp_path, synthetic_dataset_dir, no_tokenizer_training, capsys
):
    flags = ["--dataset_name", synthetic_dataset_dir, "--image_column", "image_description"]
    assert main(_train(tmp_path, *flags)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert "--image_column 'image_description' holds text that names no file" in line
    assert "name the column of images" in line


def _jpeg(shade: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (shade, 0, 0)).save(out, format="JPEG")
    return out.getvalue()


def test_a_vqa_split_without_answers_is_refused_before_a_tokenizer_is_trained(tmp_path, no_tokenizer_training, capsys):
    questions = datasets.Dataset.from_dict(
        {"image": [_jpeg(40 * i) for i in range(4)], "question": [f"what colour is square {i}?" for i in range(4)]}
    )
    datasets.DatasetDict({"train": questions}).save_to_disk(str(tmp_path / "data"))
    assert main(_train(tmp_path, "--dataset_name", str(tmp_path / "data"), "--task", "vqa")) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert "has no answers: a VQA split (--task vqa) needs an 'answers' column" in line
    assert line.endswith("its columns: image, question")


def test_a_streamed_vqa_split_without_an_answer_vocabulary_is_refused_before_a_tokenizer_is_trained(
    tmp_path, no_tokenizer_training, capsys
):
    rows = {"image": [_jpeg(40 * i) for i in range(4)], "question": [f"what colour is square {i}?" for i in range(4)],
            "answers": [["red"]] * 4}  # fmt: skip
    datasets.Dataset.from_dict(rows).to_parquet(str(tmp_path / "train.parquet"))
    flags = ["--task", "vqa", "--streaming", "--train_file", str(tmp_path / "train.parquet")]
    assert main(_train(tmp_path, *flags)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert "--task vqa on a streamed training split" in line
    assert "give the answers with --answer_vocabulary FILE" in line


@pytest.mark.parametrize(
    ("preset", "flag", "value", "words"),
    [
        ("siglip2-tiny", "--max_num_patches", "100000", "give 1 to 4096 (patches per image"),
        ("tiny", "--max_seq_length", "0", "give at least 1 (tokens per caption"),
    ],
)
def test_a_size_flag_out_of_range_is_refused_before_a_tokenizer_is_trained(
    tmp_path, synthetic_dataset_dir, no_tokenizer_training, capsys, preset, flag, value, words
):
    flags = ["--dataset_name", synthetic_dataset_dir, "--model_preset", preset, flag, value]
    assert main(_train(tmp_path, *flags)) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert f"{flag} {value} is out of range: {words}" in line
    assert not (tmp_path / "run").exists()
