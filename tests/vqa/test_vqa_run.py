"""A tiny ``--task vqa`` run on synthetic questions: it learns, evaluates, answers, and its folder loads in plain
transformers as its model card says."""

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def vqa_run(tmp_path_factory):
    """Synthetic questions (make-data --task vqa) and a 24-step --task vqa run of the tiny preset on them."""
    import vlfit
    from vlfit.commands.make_data import main as make_data

    root = tmp_path_factory.mktemp("vqa")
    data = root / "data"
    make_data([
        "--task", "vqa", "--output_dir", str(data), "--num_samples", "200", "--validation_fraction", "0.2",
        "--test_fraction", "0", "--min_long_side", "64", "--max_long_side", "96", "--format", "parquet",
        "--num_proc", "1",
    ])  # fmt: skip
    result = vlfit.train(
        task="vqa", model_preset="tiny", train_file=str(data / "train.parquet"),
        validation_file=str(data / "validation.parquet"), output_dir=str(root / "run"), max_steps=24,
        per_device_train_batch_size=32, learning_rate=2e-3, lr_scheduler_type="constant", do_eval=True,
        save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
    )  # fmt: skip
    return data, root / "run", result.metrics


def test_learns_above_the_majority_answer(vqa_run):
    _, _, metrics = vqa_run
    assert metrics["eval_vqa_questions"] == 40
    assert metrics["eval_vqa_accuracy"] > metrics["eval_vqa_accuracy_majority_answer"] + 0.05
    assert {"eval_vqa_accuracy_yes_no", "eval_vqa_accuracy_number", "eval_vqa_accuracy_other"} <= set(metrics)


def test_eval_of_the_saved_model_needs_no_task_flag(vqa_run, tmp_path):
    import vlfit

    data, run, metrics = vqa_run
    result = vlfit.evaluate(
        model_name_or_path=str(run), validation_file=str(data / "validation.parquet"), output_dir=str(tmp_path)
    )
    assert result.metrics["eval_vqa_accuracy"] == pytest.approx(metrics["eval_vqa_accuracy"])


def test_answer_api_cli_and_plain_transformers_agree(vqa_run, tmp_path, capsys):
    import datasets
    from PIL import Image
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoProcessor, BridgeTowerModel

    import vlfit

    data, run, _ = vqa_run
    row = datasets.load_dataset("parquet", data_files=str(data / "validation.parquet"))["train"][0]
    image = tmp_path / "image.png"
    row["image"].save(image)
    question = row["question"]
    answers = vlfit.load(str(run)).answer(str(image), question, top_k=2)
    assert len(answers) == 1 and len(answers[0]) == 2 and answers[0][0][1] >= answers[0][1][1]

    from vlfit.cli import main

    capsys.readouterr()
    assert main(["vqa", "--model", str(run), str(image), question, "--top_k", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].split("\t")[:2] == [question, answers[0][0][0]]

    # The model card's recipe: the backbone in plain transformers, the head rebuilt from the config.
    assert "BridgeTowerModel.from_pretrained(path)" in (run / "README.md").read_text()
    config = AutoConfig.from_pretrained(run)
    backbone = BridgeTowerModel.from_pretrained(run).eval()
    h = config.hidden_size
    head = torch.nn.Sequential(
        torch.nn.Linear(2 * h, 4 * h),
        torch.nn.LayerNorm(4 * h),
        torch.nn.GELU(),
        torch.nn.Linear(4 * h, config.num_labels),
    )
    weights = load_file(run / "model.safetensors")
    head.load_state_dict({k.removeprefix("vqa_classifier."): v for k, v in weights.items() if k.startswith("vqa_")})
    inputs = AutoProcessor.from_pretrained(run)(images=[Image.open(image).convert("RGB")], text=[question],
                                                return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        scores = head.eval()(backbone(**inputs).pooler_output).sigmoid()[0]
    assert config.id2label[int(scores.argmax())] == answers[0][0][0]
    assert float(scores.max()) == pytest.approx(answers[0][0][1], abs=0.02)
    assert json.loads((run / "config.json").read_text())["architectures"] == ["BridgeTowerForQuestionAnswering"]


def test_a_vqa_model_answers_but_is_refused_as_an_embedder_in_one_line(vqa_run, tmp_path, capsys):
    import datasets

    import vlfit
    from vlfit.cli import main

    data, run, _ = vqa_run
    model = vlfit.load(str(run))  # the question answerer alone: no contrastive model is built beside it
    assert "encoder" not in vars(model.runtime) and model.image_size == model.runtime.answerer.image_size
    with pytest.raises(vlfit.ConfigError, match="is a question-answering model .*no contrastive heads to embed"):
        model.encode_texts("a red circle")
    # Every command that embeds opens its model through one door, which refuses it before any weight loads.
    images = tmp_path / "images"
    images.mkdir()
    datasets.load_dataset("parquet", data_files=str(data / "validation.parquet"))["train"][0]["image"].save(
        images / "one.png"
    )
    argv = ["retrieve", "index", "--model", str(run), "--images", str(images), "--output_dir", str(tmp_path / "i")]
    assert main(argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "is a question-answering model (vlfit train --task vqa)" in errors[0]


def test_lora_adapters_of_a_vqa_run_keep_its_answers_through_reload_and_merge(vqa_run, tiny_checkpoint, tmp_path):
    """A VQA run with LoRA on a contrastive checkpoint: the base's config lists no answers, so the adapters' folder
    keeps the model's config; loading, evaluating and merging the adapters give the run's VQA model."""
    import datasets
    from PIL import Image

    import vlfit
    from vlfit.cli import main

    data, _, _ = vqa_run
    adapters = tmp_path / "lora"
    run = vlfit.train(
        task="vqa", model_name_or_path=str(tiny_checkpoint), lora_r=8, train_file=str(data / "train.parquet"),
        validation_file=str(data / "validation.parquet"), output_dir=str(adapters), max_steps=24,
        per_device_train_batch_size=32, learning_rate=2e-3, lr_scheduler_type="constant", do_eval=True,
        save_strategy="no", report_to="none", seed=0, disable_tqdm=True,
    )  # fmt: skip
    assert (adapters / "adapter_config.json").is_file() and not (adapters / "model.safetensors").exists()
    saved = json.loads((adapters / "config.json").read_text())
    assert saved["architectures"] == ["BridgeTowerForQuestionAnswering"] and len(saved["id2label"]) > 2

    # Evaluated again from the folder, with no --task flag: the run's own figures, question type by question type.
    again = vlfit.evaluate(model_name_or_path=str(adapters), validation_file=str(data / "validation.parquet"),
                           output_dir=str(tmp_path / "eval"))  # fmt: skip
    figures = {k: v for k, v in run.metrics.items() if k.startswith("eval_vqa_accuracy")}
    assert len(figures) > 3 and {k: again.metrics[k] for k in figures} == pytest.approx(figures)

    row = datasets.load_dataset("parquet", data_files=str(data / "validation.parquet"))["train"][0]
    image = Image.open(row["image"]["path"]) if isinstance(row["image"], dict) else row["image"]
    answered = vlfit.load(str(adapters)).answer(image, row["question"], top_k=3)
    photo = tmp_path / "image.png"
    image.convert("RGB").save(photo)
    printed = subprocess.run([sys.executable, "-m", "vlfit", "vqa", "--model", str(adapters), str(photo),
                              row["question"], "--top_k", "1"], capture_output=True, text=True, check=True)  # fmt: skip
    assert printed.stdout.split("\t")[1] == answered[0][0][0]
    # The contrastive base's heads and the classifier it lacks are what is meant: no load report of transformers'.
    assert "LOAD REPORT" not in printed.stderr
    # Nothing embeds with it (it loaded as a contrastive model with random heads before).
    with pytest.raises(vlfit.ConfigError, match="is a question-answering model"):
        vlfit.load(str(adapters)).encode_texts("a red circle")
    assert main(["merge-lora", "--model_name_or_path", str(adapters), "--output_dir", str(tmp_path / "merged")]) == 0
    merged = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert merged["architectures"] == ["BridgeTowerForQuestionAnswering"] and merged["id2label"] == saved["id2label"]
    assert "vlfit.load(" in (tmp_path / "merged" / "README.md").read_text()  # the card shows how to ask it
    merged_answers = vlfit.load(str(tmp_path / "merged")).answer(image, row["question"], top_k=3)
    assert [a for a, _ in merged_answers[0]] == [a for a, _ in answered[0]]
    assert [s for _, s in merged_answers[0]] == pytest.approx([s for _, s in answered[0]], abs=1e-4)


def test_the_majority_baseline_is_the_most_given_training_answer_not_the_vocabulary_files_first(vqa_run, tmp_path):
    import collections

    import datasets

    import vlfit
    from vlfit.data.vqa import annotator_answers
    from vlfit.evaluation.vqa_accuracy import answer_accuracy

    data, _, _ = vqa_run

    def answers(split):
        rows = datasets.load_dataset("parquet", data_files=str(data / f"{split}.parquet"))["train"]
        return [annotator_answers(row, str(i)) for i, row in enumerate(rows.remove_columns("image"))]

    counts = collections.Counter(answer for row in answers("train") for answer in row)
    most = min(counts, key=lambda answer: (-counts[answer], answer))
    rarest_first = [answer for answer in sorted(counts, key=counts.get) if answer != most] + [most]
    vocabulary = tmp_path / "answers.txt"
    vocabulary.write_text("\n".join(rarest_first) + "\n")
    result = vlfit.train(
        task="vqa", model_preset="tiny", answer_vocabulary=str(vocabulary), train_file=str(data / "train.parquet"),
        validation_file=str(data / "validation.parquet"), output_dir=str(tmp_path / "run"), max_steps=1,
        per_device_train_batch_size=8, do_eval=True, save_strategy="no", report_to="none", disable_tqdm=True,
    )  # fmt: skip

    def baseline(answer):
        scores = [answer_accuracy(answer, row) for row in answers("validation")]
        return sum(scores) / len(scores)

    assert baseline(most) != pytest.approx(baseline(rarest_first[0]))  # the two tell apart
    assert result.metrics["eval_vqa_accuracy_majority_answer"] == pytest.approx(baseline(most))


def test_questions_are_answered_in_batches_through_one_runtime(vqa_run, tmp_path):
    import datasets
    import numpy as np

    import vlfit

    data, run, _ = vqa_run
    rows = datasets.load_dataset("parquet", data_files=str(data / "validation.parquet"))["train"].select(range(5))
    images = np.stack([np.asarray(row["image"].convert("RGB").resize((80, 64))) for row in rows])  # [5, H, W, 3]
    questions = [row["question"] for row in rows]
    model = vlfit.load(str(run))
    forwards = []
    model.runtime.answerer.loaded.model.register_forward_hook(lambda module, args, out: forwards.append(1))
    batched = model.answer(images, questions, top_k=2, batch_size=2)  # a [N, H, W, C] uint8 batch, as encode_images
    assert len(forwards) == 3 and len(batched) == 5
    one_by_one = [model.answer(image, question, top_k=2)[0] for image, question in zip(images, questions, strict=True)]
    assert [[a for a, _ in row] for row in batched] == [[a for a, _ in row] for row in one_by_one]
    assert np.allclose([[s for _, s in row] for row in batched], [[s for _, s in row] for row in one_by_one], atol=1e-5)
    with pytest.raises(vlfit.ConfigError, match=r"int8 runs on exported graphs only, and a question-answering model"):
        vlfit.load(str(run), precision="int8")
