"""The parts of ``vlfit fewshot``: labelled synthetic sets, shot drawing, heads, SetFit's tuning, every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.inference.tiny_models import save_tiny_checkpoint
from vlfit.data.records import Record
from vlfit.data.sources import LabelledSplit, labelled_splits
from vlfit.data.sources.memory import MemorySource
from vlfit.data.synthetic import LABEL_CLASSES, REGIONS, SyntheticConfig, make_dataset
from vlfit.data.synthetic.scenes import parse_caption
from vlfit.fewshot.experiment import FewShotSettings, run_fewshot
from vlfit.fewshot.heads import (
    DEFAULT_C,
    LinearHead,
    anchored_head,
    choose_head,
    logistic_candidates,
    sklearn_logistic_head,
)
from vlfit.fewshot.setfit import SetFitSettings, WeightSnapshot, image_parameters, pair_loss, tune_image_tower
from vlfit.fewshot.shots import ShotSampler
from vlfit.inference.runtime import ModelRuntime


@pytest.mark.parametrize("attribute", ["kind", "colour", "region"])
def test_a_labelled_set_shares_its_class_attribute_in_every_group_and_choice(attribute) -> None:
    config = SyntheticConfig(num_samples=24, seed=2, min_long_side=48, max_long_side=64, labels=attribute)
    split = make_dataset(config)["train"]
    assert split.features[attribute].names == list(LABEL_CLASSES[attribute])
    for row in split:
        scenes = [parse_caption(row["image_description"]), *map(parse_caption, row["caption_choices"])]
        if attribute == "region":
            assert all(len(scene) == 1 for scene in scenes)
            assert REGIONS[row[attribute]] == scenes[0][0].region
        else:
            assert all(len({getattr(group, attribute) for group in scene}) == 1 for scene in scenes)
            assert LABEL_CLASSES[attribute][row[attribute]] == getattr(scenes[0][0], attribute)
    assert len(set(split[attribute])) > 1


@pytest.mark.slow
def test_shots_are_the_same_per_seed_nested_over_counts_and_skip_a_bad_image(labelled_checkpoint,
                                                                             labelled_dataset_dir) -> None:  # fmt: skip
    train, _ = labelled_splits(labelled_dataset_dir, train_split="train", eval_split="test", label_column="kind")
    spec = ModelRuntime.open(str(labelled_checkpoint)).encoder.spec
    sampler = ShotSampler(train, spec)
    two, again, other = sampler.draw(2, seed=0), ShotSampler(train, spec).draw(2, seed=0), sampler.draw(2, seed=1)
    assert np.bincount(two.labels).tolist() == [2, 2, 2, 2] and (two.labels == train.labels[two.rows]).all()
    assert two.rows.tolist() == again.rows.tolist() and torch.equal(two.images["pixels"], again.images["pixels"])
    assert two.rows.tolist() != other.rows.tolist()
    assert set(sampler.draw(1, seed=0).rows) <= set(two.rows)
    # The first image of class 0's order does not decode: it is listed, and the next of the class replaces it.
    broken_row = int(sampler.order(0, seed=0)[0])
    records = [train.source[i] for i in range(len(train))]
    records[broken_row] = Record(records[broken_row].id, b"not a jpeg", "circle")
    broken = LabelledSplit(MemorySource(records, "broken"), train.labels, train.class_names, "kind")
    drawn = ShotSampler(broken, spec).draw(2, seed=0)
    assert broken_row not in drawn.rows and np.bincount(drawn.labels).tolist() == [2, 2, 2, 2]
    assert int(sampler.order(0, seed=0)[2]) in drawn.rows
    # Rows showing an image already drawn (its bytes repeated: another caption of it) are passed over.
    first, second = (int(row) for row in sampler.order(0, seed=0)[:2])
    records = [train.source[i] for i in range(len(train))]
    records[second] = Record(records[second].id, records[first].image, "circle")
    repeated = LabelledSplit(MemorySource(records, "repeated"), train.labels, train.class_names, "kind")
    drawn = ShotSampler(repeated, spec).draw(2, seed=0)
    assert first in drawn.rows and second not in drawn.rows and np.bincount(drawn.labels).tolist() == [2, 2, 2, 2]


def test_a_two_class_logistic_head_gives_scikit_learns_probabilities() -> None:
    from sklearn.linear_model import LogisticRegression

    rng = np.random.default_rng(0)
    x = torch.from_numpy(rng.normal(size=(20, 5)).astype(np.float32))
    y = (x[:, 0] > 0).long().numpy()
    head = sklearn_logistic_head(x, y, c=DEFAULT_C, num_classes=2)
    expected = LogisticRegression(C=DEFAULT_C, max_iter=2000).fit(x.numpy(), y).predict_proba(x.numpy())
    np.testing.assert_allclose(head.probabilities(x).numpy(), expected, rtol=1e-4, atol=1e-5)


def test_an_anchored_head_stays_at_a_strong_anchor_and_leaves_a_weak_one() -> None:
    rng = np.random.default_rng(1)
    x = torch.nn.functional.normalize(torch.from_numpy(rng.normal(size=(12, 4)).astype(np.float32)), dim=-1)
    y = np.arange(12) % 3
    anchor = LinearHead(torch.from_numpy(rng.normal(size=(3, 4)).astype(np.float32)), torch.zeros(3))
    strong = anchored_head(x, y, anchor, strength=1e6)
    torch.testing.assert_close(strong.weight, anchor.weight, atol=1e-3, rtol=0)
    weak = anchored_head(x, y, anchor, strength=1e-4)
    assert (weak.weight - anchor.weight).abs().max() > 0.1
    assert (weak.predict(x).numpy() == y).mean() > (anchor.predict(x).numpy() == y).mean()


def test_one_shot_per_class_takes_the_fallback_head() -> None:
    x = torch.eye(3)
    head, name = choose_head(x, np.arange(3), logistic_candidates(3), "logistic C=10", seed=0)
    assert name == "logistic C=10" and head.predict(x).tolist() == [0, 1, 2]


def test_pair_loss_is_the_balanced_squared_error_of_cosine_similarities() -> None:
    e = torch.nn.functional.normalize(torch.tensor([[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]]), dim=-1)
    labels = torch.tensor([0, 0, 1])
    cosine = e @ e.T
    positives = (cosine[0, 1] - 1) ** 2  # (0,1) and (1,0)
    negatives = (cosine[0, 2] ** 2 + cosine[1, 2] ** 2) / 2
    torch.testing.assert_close(pair_loss(e, labels), (positives + negatives) / 2)


@pytest.mark.slow
def test_setfit_tunes_only_the_image_tower_and_a_snapshot_puts_it_back(labelled_checkpoint) -> None:
    loaded = ModelRuntime.open(str(labelled_checkpoint)).encoder
    tower = loaded.image_tower
    size = loaded.spec.image_size
    pixels = torch.randint(0, 256, (8, 3, size, size), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = np.arange(8) % 2
    parameters = image_parameters(tower, {"pixels": pixels[:1]})
    everything = {name: p.detach().clone() for name, p in loaded.model.named_parameters()}
    snapshot = WeightSnapshot(parameters)
    settings = SetFitSettings(steps=8, learning_rate=1e-3)
    losses = tune_image_tower(tower, parameters, {"pixels": pixels}, labels, settings, seed=0)
    assert losses[-1] < losses[0]
    changed = {name for name, p in loaded.model.named_parameters() if not torch.equal(p, everything[name])}
    assert changed and all(name.startswith("model.") for name in parameters)
    assert changed <= {name.removeprefix("model.") for name in parameters}
    assert not any("text" in name for name in changed)
    snapshot.restore()
    assert all(torch.equal(p, everything[name]) for name, p in loaded.model.named_parameters())


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["clip-tiny", "siglip-tiny"])
def test_every_method_runs_on_the_dual_encoders(preset, labelled_dataset_dir, tmp_path) -> None:
    folder = save_tiny_checkpoint(labelled_dataset_dir, tmp_path / preset, preset=preset)
    loaded = ModelRuntime.open(str(folder)).encoder
    before = {name: p.detach().clone() for name, p in loaded.model.named_parameters()}
    train, evaluation = labelled_splits(labelled_dataset_dir, train_split="train", eval_split="test",
                                        label_column="kind")  # fmt: skip
    settings = FewShotSettings(shot_counts=[2], seeds=[0], setfit=SetFitSettings(steps=2, learning_rate=1e-3))
    results = run_fewshot(loaded, train, evaluation, settings, log=lambda line: None)
    assert [(run.method, run.shots) for run in results.runs] == [("zeroshot", 0), ("linear_probe", 2), ("setfit", 2)]
    assert all(0 <= run.accuracy <= 1 for run in results.runs)
    # SetFit tuned the image tower and put its weights back.
    assert all(torch.equal(p, before[name]) for name, p in loaded.model.named_parameters())


@pytest.mark.slow
def test_a_saved_setfit_classifier_reloads_to_the_labels_it_gave_in_memory(labelled_checkpoint, labelled_dataset_dir,
                                                                            tmp_path) -> None:  # fmt: skip
    from vlfit.fewshot.classifier import Classifier, ClassifierInfo, save_classifier
    from vlfit.fewshot.images import decode_rows, embed_images

    loaded = ModelRuntime.open(str(labelled_checkpoint)).encoder
    train, evaluation = labelled_splits(labelled_dataset_dir, train_split="train", eval_split="test",
                                        label_column="kind")  # fmt: skip
    settings = FewShotSettings(shot_counts=[2], seeds=[0], methods=["setfit"],
                               setfit=SetFitSettings(steps=3, learning_rate=1e-3))  # fmt: skip
    kept = run_fewshot(loaded, train, evaluation, settings, keep_largest=True, log=lambda line: None).kept
    (classifier,) = kept.values()
    # The tuned image tower, as the command puts it into the saved checkpoint, and its labels in memory.
    classifier.image_weights.restore()
    images = decode_rows(evaluation.source, range(len(evaluation)), loaded.spec).stacked(range(len(evaluation)))
    in_memory = classifier.head.predict(embed_images(loaded.image_tower, images)).tolist()
    info = ClassifierInfo("setfit", train.class_names, "kind", 2, 0, classifier.run.head, classifier.run.accuracy,
                          [], str(labelled_checkpoint))  # fmt: skip
    save_classifier(str(tmp_path / "clf"), loaded.save, classifier.head, info)
    reloaded = Classifier(str(tmp_path / "clf"))
    predictions = reloaded.predict(images, [str(i) for i in range(len(evaluation))])
    assert [train.class_names.index(p.label) for p in predictions] == in_memory
    assert classifier.run.accuracy == pytest.approx(float((np.array(in_memory) == evaluation.labels).mean()))
