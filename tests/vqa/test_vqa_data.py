"""VQA data: annotator answers, the answer vocabulary and soft targets, the synthetic questions, and bad input."""

import dataclasses
import json

import pytest
import torch

from vlfit.data.synthetic import SyntheticConfig
from vlfit.data.synthetic.questions import ANNOTATORS, QUESTION_TYPES, make_question_record
from vlfit.data.vqa import AnswerVocabulary, annotator_answers
from vlfit.errors import ConfigError, DataError


def test_answers_as_strings_dicts_or_multiple_choice():
    assert annotator_answers({"answers": ["Two", "2"]}, "q1") == ["2", "2"]
    assert annotator_answers({"answers": [{"answer": "yes", "answer_id": 1}]}, "q2") == ["yes"]
    assert annotator_answers({"multiple_choice_answer": "the red ball"}, "q3") == ["red ball"]


def test_question_without_answers_is_one_clear_line():
    with pytest.raises(DataError, match="question q7 has no answers") as error:
        annotator_answers({"answers": [], "multiple_choice_answer": None}, "q7")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("value", [3, "yes", [1, 2], [{"text": "yes"}]])
def test_answer_column_of_the_wrong_type_is_one_clear_line(value):
    with pytest.raises(DataError, match="question q8: the 'answers' column holds") as error:
        annotator_answers({"answers": value}, "q8")
    assert "\n" not in str(error.value)


def test_vocabulary_and_soft_targets():
    answers = [["yes"] * 10, ["no"] * 9 + ["yes"], ["2", "2", "3"], ["red"]]
    vocabulary = AnswerVocabulary.build(answers, max_answers=3)
    assert vocabulary.answers == ("yes", "no", "2")  # most given first; "3" and "red" fall out
    targets = vocabulary.targets(answers)
    expected = torch.tensor(
        [[1.0, 0.0, 0.0], [1 / 3, 1.0, 0.0], [0.0, 0.0, 2 / 3], [0.0, 0.0, 0.0]]  # min(count / 3, 1)
    )
    assert torch.allclose(targets, expected)


def test_synthetic_questions_have_ten_answers_some_disagreeing():
    config = SyntheticConfig(num_samples=40, min_long_side=48, max_long_side=64)
    rows = [make_question_record(i, config) for i in range(40)]
    assert {row["question_type"] for row in rows} == set(QUESTION_TYPES)
    assert all(len(row["answers"]) == ANNOTATORS for row in rows)
    assert any(len(set(row["answers"])) > 1 for row in rows)
    assert all(row["multiple_choice_answer"] in row["answers"] for row in rows)
    assert rows[0] == make_question_record(0, config)  # deterministic
    assert {row["answer_type"] for row in rows} == {"yes/no", "number", "other"}


def test_vqa_task_refuses_a_dual_encoder(tmp_path):
    from vlfit.models.loading import resolve_model
    from vlfit.training.vqa import vqa_blueprint

    spec = resolve_model(model_preset="clip-tiny", captions=lambda: ["a red circle"] * 4)
    with pytest.raises(ConfigError, match="--task vqa fine-tunes BridgeTower.*clip model") as error:
        vqa_blueprint(spec, None, None, 10, train=True)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("answers.txt", "Yes\nno\n\nTwo\n2\n"),
        ("answers.json", '["Yes", "no", "Two", "2"]'),
        ("ans2label.json", '{"no": 1, "yes": 0, "2": 2}'),  # METER's and ViLT's form: the order of the indices
    ],
)
def test_an_answer_vocabulary_file_in_each_form(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    assert AnswerVocabulary.read(str(path)).answers == ("yes", "no", "2")  # normalised as the data is, once each


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("empty.txt", "\n  \n", "holds no answer"),
        ("bad.json", '{"yes": "a"}', "expected a JSON list of answers or an {answer: index} map"),
        ("broken.json", "[", "not valid JSON"),
        ("missing.txt", None, "cannot read it"),
    ],
)
def test_a_bad_answer_vocabulary_file_is_one_line_naming_it(tmp_path, name, text, message):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(DataError) as error:
        AnswerVocabulary.read(str(path))
    line = str(error.value)
    assert line.startswith(f"--answer_vocabulary {path}") and message in line and "\n" not in line


def test_answer_vocabulary_refusals_name_the_flag():
    from vlfit.models.loading import resolve_model
    from vlfit.training.vqa import vqa_blueprint

    spec = resolve_model(model_preset="tiny", captions=lambda: ["a red circle"] * 4)
    with pytest.raises(ConfigError, match="^--task vqa on a streamed training split: .*--answer_vocabulary FILE"):
        vqa_blueprint(spec, None, None, 10, train=True)  # a stream: no map-style training split
    with pytest.raises(ConfigError, match="^--answer_vocabulary sets the answers a training run learns"):
        vqa_blueprint(spec, None, None, 10, train=False, vocabulary_file="answers.txt")


def test_vqa_flags_on_a_retrieval_run_and_a_vocabulary_on_an_evaluation_alone_refused(tmp_path, synthetic_dataset_dir):
    from vlfit.arguments import DataArguments, ModelArguments
    from vlfit.training.arguments import VlfitTrainingArguments
    from vlfit.training.run import setup_run

    args = VlfitTrainingArguments(output_dir=str(tmp_path / "o"), do_train=True, report_to="none")
    data = DataArguments(dataset_name=synthetic_dataset_dir, answer_vocabulary="answers.txt")
    retrieval = r"is a flag of --task vqa \(its answers\); this run is a retrieval run: add --task vqa or drop it$"
    with pytest.raises(ConfigError, match="^--answer_vocabulary " + retrieval):
        setup_run(ModelArguments(model_preset="tiny"), data, args)
    with pytest.raises(ConfigError, match="^--max_answers " + retrieval):
        setup_run(ModelArguments(model_preset="tiny"), DataArguments(dataset_name=str(tmp_path), max_answers=10), args)
    # An evaluation alone is refused before its data opens (the folder named here does not exist).
    alone = VlfitTrainingArguments(output_dir=str(tmp_path / "e"), do_eval=True, report_to="none")
    nowhere = DataArguments(dataset_name=str(tmp_path / "nowhere"), task="vqa", answer_vocabulary="answers.txt")
    with pytest.raises(ConfigError, match="^--answer_vocabulary sets the answers a training run learns"):
        setup_run(ModelArguments(model_preset="tiny"), nowhere, alone)


@pytest.mark.parametrize(
    ("flags", "refused"),
    [
        ({"objective": "contrastive+itm"}, "--objective"),
        ({"hard_negative_column": "caption_choices"}, "--hard_negative_column"),
        ({"gradient_cache_chunk_size": 4}, "--gradient_cache_chunk_size"),
        ({"zeroshot_dataset": ["labelled"]}, "--zeroshot_dataset"),
        ({"logit_scale_init_value": 2.0}, "--logit_scale_init_value"),
    ],
)
def test_a_retrieval_flag_on_a_vqa_run_is_refused_before_its_data_opens(tmp_path, flags, refused):
    from vlfit.arguments import DataArguments, ModelArguments
    from vlfit.training.arguments import VlfitTrainingArguments
    from vlfit.training.run import setup_run

    def take(cls, **given):  # each flag to the dataclass that declares it
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in flags.items() if k in known}, **given)

    args = take(VlfitTrainingArguments, output_dir=str(tmp_path / "o"), do_train=True, report_to="none")
    data = take(DataArguments, dataset_name=str(tmp_path / "nowhere"), task="vqa")
    with pytest.raises(ConfigError, match=f"^{refused} is a retrieval run's flag; --task vqa .*: drop it$"):
        setup_run(take(ModelArguments, model_preset="tiny"), data, args)


def test_wise_ft_on_a_vqa_run_needs_a_start_with_a_vqa_head(tmp_path):
    from vlfit.arguments import DataArguments, ModelArguments
    from vlfit.training.arguments import VlfitTrainingArguments
    from vlfit.training.run import setup_run

    args = VlfitTrainingArguments(output_dir=str(tmp_path / "o"), do_train=True, report_to="none", wise_ft_alpha=0.5)
    data = DataArguments(dataset_name=str(tmp_path / "nowhere"), task="vqa")
    contrastive = tmp_path / "contrastive"  # what tells a VQA folder apart: its config's architectures
    contrastive.mkdir()
    (contrastive / "config.json").write_text(json.dumps({"architectures": ["BridgeTowerForContrastiveLearning"]}))
    with pytest.raises(ConfigError, match=f"^--wise_ft_alpha .* {contrastive} has no VQA head to mix"):
        setup_run(ModelArguments(model_name_or_path=str(contrastive)), data, args)
