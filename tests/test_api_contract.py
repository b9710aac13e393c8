"""The Python API keeps the CLI's promise: every public entry point, called with a wrong keyword, a value of the
wrong type or an array of the wrong shape, raises a ``vlfit.UserError`` naming the keyword (``precision=``, never
``--precision``), before anything is loaded or written."""

import inspect
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import vlfit
from vlfit.commands.train import parser_for
from vlfit.errors import cli_wording


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return vlfit.load(str(tiny_checkpoint))  # a saved model: an index of a preset is refused


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(folder / f"{name}.png")
    return folder


@pytest.fixture(scope="module")
def index(model, photos, tmp_path_factory):
    return vlfit.Index.build(model, str(tmp_path_factory.mktemp("index") / "index"), images=str(photos))


GOOD = np.zeros((32, 32, 3), dtype=np.uint8)

# (entry point, call, the error's kind, what its message holds); `out` is a folder the call must leave empty.
CASES = [
    ("load", lambda m, i, p, out: vlfit.load("clip-tiny", precison="int8"), vlfit.ArgumentError,
     "`precison=` (did you mean `precision=`?)"),
    ("load", lambda m, i, p, out: vlfit.load(5), vlfit.ArgumentError, "`path_or_preset=`"),
    ("load", lambda m, i, p, out: vlfit.load(str(out / "nope")), vlfit.MissingFileError, "`path_or_preset="),
    ("load", lambda m, i, p, out: vlfit.load("clip-tiny", backend="tensorrt"), vlfit.ConfigError,
     "`backend='tensorrt'`"),
    ("load", lambda m, i, p, out: vlfit.load("clip-tiny", precision="int9"), vlfit.ConfigError, "`precision='int9'`"),
    ("load", lambda m, i, p, out: vlfit.load("clip-tiny", num_threads="2"), vlfit.ArgumentError, "`num_threads=`"),
    ("Model.encode_images", lambda m, i, p, out: m.encode_images(5), vlfit.ArgumentError, "`images=`"),
    ("Model.encode_images", lambda m, i, p, out: m.encode_images([GOOD, 5]), vlfit.DataError, "images[1]"),
    ("Model.encode_images", lambda m, i, p, out: m.encode_images(GOOD, batch_size=0), vlfit.ConfigError,
     "`batch_size=` must be at least 1"),
    ("Model.encode_texts", lambda m, i, p, out: m.encode_texts(5), vlfit.ArgumentError, "`texts=`"),
    ("Model.encode_texts", lambda m, i, p, out: m.encode_texts(["a", 3]), vlfit.DataError, "texts[1]"),
    ("Model.encode_texts", lambda m, i, p, out: m.encode_texts("a", batch_siz=2), vlfit.ArgumentError,
     "did you mean `batch_size=`?"),
    ("Model.similarity", lambda m, i, p, out: m.similarity(GOOD, 5), vlfit.ArgumentError, "`texts=`"),
    ("Model.answer", lambda m, i, p, out: m.answer(GOOD, 5), vlfit.ArgumentError, "`questions=`"),
    ("Model.answer", lambda m, i, p, out: m.answer(GOOD, "what colour?", top_k=0), vlfit.ConfigError,
     "`top_k=` must be at least 1"),
    ("Model.answer", lambda m, i, p, out: m.answer([GOOD, GOOD], ["a?", "b?", "c?"]), vlfit.DataError,
     "2 images for 3 questions"),
    ("train", lambda m, i, p, out: vlfit.train(model_preset="clip-tiny", output_dir=str(out), max_steps="ten"),
     vlfit.ConfigError, "`max_steps=` takes an int, got 'ten'"),
    ("train", lambda m, i, p, out: vlfit.train(model_preset="clip-tiny", output_dir=str(out), learning_rate="fast"),
     vlfit.ConfigError, "`learning_rate=` takes a number, got 'fast'"),
    ("train", lambda m, i, p, out: vlfit.train(model_preset="clip-tiny", output_dir=str(out), max_steps=1.5),
     vlfit.ConfigError, "`max_steps=` takes an int, got float 1.5"),
    ("train", lambda m, i, p, out: vlfit.train(model_preset="clip-tiny", output_dir=str(out), precison="bf16"),
     vlfit.ArgumentError, "`precison=`"),
    ("train", lambda m, i, p, out: vlfit.train("clip-tiny", output_dir=str(out)), vlfit.ArgumentError, "train()"),
    ("train", lambda m, i, p, out: vlfit.train(model_preset="clip-tiny", output_dir=str(out), image_pipeline="turbo"),
     vlfit.ConfigError, "`image_pipeline='turbo'`: choose one of fast, reference"),
    ("evaluate", lambda m, i, p, out: vlfit.evaluate(model="clip-tiny", output_dir=str(out), max_eval_samples="x"),
     vlfit.ConfigError, "`max_eval_samples=` takes an int"),
    ("evaluate", lambda m, i, p, out: vlfit.evaluate(model="clip-tiny", output_dir=str(out), eval_splt="test"),
     vlfit.ArgumentError, "did you mean `eval_split=`"),
    ("merge", lambda m, i, p, out: vlfit.merge(method="soup", runs=[str(p)], output_dir=str(out / "m")),
     vlfit.ConfigError, "`method='soup'`: choose one of wise, uniform, greedy, stock"),
    ("merge", lambda m, i, p, out: vlfit.merge(method="uniform", run=[str(p)], output_dir=str(out / "m")),
     vlfit.ArgumentError, "did you mean `runs=`?"),
    ("merge", lambda m, i, p, out: vlfit.merge(method="greedy", runs=[str(p)], output_dir=str(out / "m")),
     vlfit.ConfigError, "`validation_file=` FILE or `dataset_name=` DATA"),
    ("merge", lambda m, i, p, out: vlfit.merge(method="stock", runs=[str(p), str(p)], output_dir=str(out / "m")),
     vlfit.ConfigError, "`method='stock'` needs `base=`"),
    ("Index.build", lambda m, i, p, out: vlfit.Index.build(m, str(out / "index"), image_folder=str(p)),
     vlfit.ArgumentError, "`images=`"),
    ("Index.build", lambda m, i, p, out: vlfit.Index.build(m, str(out / "index"), images=str(p), batch_size="8"),
     vlfit.ArgumentError, "`batch_size=`"),
    ("Index.build", lambda m, i, p, out: vlfit.Index.build(m, str(out / "index"), images=str(p), index_type="lsh"),
     vlfit.ConfigError, "`index_type='lsh'`"),
    ("Index.build", lambda m, i, p, out: vlfit.Index.build(m, str(out / "index"), images=str(p), target_recall=2.0),
     vlfit.ConfigError, "`target_recall=` must be in (0, 1]"),
    ("Index.build", lambda m, i, p, out: vlfit.Index.build(m, str(out / "index")), vlfit.ConfigError,
     "`images=` (a folder of image files) or `dataset_name=`"),
    ("Index.build", lambda m, i, p, out: vlfit.Index.build(m, str(out / "index"), images=str(out / "none")),
     vlfit.MissingFileError, "`images="),
    ("Index.build", lambda m, i, p, out: vlfit.Index.build(str(out / "nope"), str(out / "index"), images=str(p)),
     vlfit.MissingFileError, "`model="),
    ("Index.open", lambda m, i, p, out: vlfit.Index.open(str(out / "index")), vlfit.MissingFileError, "`path="),
    ("Index.open", lambda m, i, p, out: vlfit.Index.open(i.path, model="clip-tiny"), vlfit.ArgumentError,
     "`model=`"),
    ("Index.append", lambda m, i, p, out: i.append(batch_size=0), vlfit.ConfigError, "`batch_size=`"),
    ("Index.push", lambda m, i, p, out: i.push(5), vlfit.ArgumentError, "`uri=` must be str"),
    ("Index.push", lambda m, i, p, out: i.push("ftp://x"), vlfit.ConfigError, "`uri=ftp://x`: not a vector database"),
    ("Index.push", lambda m, i, p, out: i.push(f"lancedb:{out}/db", batch_size=0), vlfit.ConfigError,
     "`batch_size=` must be at least 1"),
    ("Index.push", lambda m, i, p, out: i.push(f"lancedb:{out}/db", overwrit=True), vlfit.ArgumentError,
     "did you mean `overwrite=`?"),
    ("Index.search", lambda m, i, p, out: i.search(np.ones((1, 7))), vlfit.DataError, "`queries=`"),
    ("Index.search", lambda m, i, p, out: i.search(np.ones((2, 3, m.embedding_dim))), vlfit.DataError, "`queries=`"),
    ("Index.search", lambda m, i, p, out: i.search("a red square", k=0), vlfit.ConfigError, "`k=`"),
    ("Index.search", lambda m, i, p, out: i.search("a red square", k="3"), vlfit.ArgumentError, "`k=`"),
    ("Index.search", lambda m, i, p, out: i.search(["a red square", 3]), vlfit.DataError, "queries[1]"),
    ("list_presets", lambda m, i, p, out: vlfit.list_presets(family="clip"), vlfit.ArgumentError, "`family=`"),
    ("add_preset", lambda m, i, p, out: vlfit.add_preset(5), vlfit.ArgumentError, "`path=`"),
    ("add_preset", lambda m, i, p, out: vlfit.add_preset(str(out / "mine.json")), vlfit.MissingFileError, "`path="),
    ("add_preset", lambda m, i, p, out: vlfit.add_preset(str(p)), vlfit.ConfigError, "`path="),
]  # fmt: skip


def _entry_points() -> set[str]:
    """Every public function and public method of a class that ``vlfit`` exports (the API's front door) that takes
    an argument."""
    names = set()
    for name in vlfit.__all__:
        value = getattr(vlfit, name)
        if inspect.isfunction(value):
            names.add(name)
        elif inspect.isclass(value) and not issubclass(value, BaseException):
            names |= {f"{name}.{attr}" for attr, member in vars(value).items()
                      if not attr.startswith("_") and isinstance(member, (classmethod, type(lambda: 0)))
                      and _takes_arguments(member)}  # fmt: skip
    return names


def _takes_arguments(member) -> bool:
    """A method that takes nothing but ``self`` (``SearchHit.to_json``) cannot be called with a bad argument."""
    function = member.__func__ if isinstance(member, classmethod) else member
    return len(inspect.signature(function).parameters) > (1 if not isinstance(member, staticmethod) else 0)


def test_the_walk_covers_every_public_entry_point():
    assert _entry_points() == {entry for entry, *_ in CASES}


@pytest.mark.parametrize(("entry", "call", "kind", "named"), CASES, ids=[f"{c[0]}-{n}" for n, c in enumerate(CASES)])
def test_a_mistake_is_a_user_error_naming_the_keyword_and_writes_nothing(
    model, index, photos, tmp_path, entry, call, kind, named
):
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(kind) as caught:
        call(model, index, photos, out)
    assert isinstance(caught.value, vlfit.UserError)
    message = str(caught.value)
    assert named in message and "--" not in message, message
    assert list(out.iterdir()) == []  # nothing written: the next correct call into the folder starts afresh


def test_strings_convert_as_on_the_command_line():
    parser = parser_for("vlfit train")
    flags = {"num_train_epochs": "2", "max_steps": "10", "learning_rate": "1e-4", "freeze_vision_model": "true"}
    (model, data, training), _ = parser.parse_values({"model_preset": "tiny", "output_dir": Path("/tmp/x"), **flags})
    argv = ["--model_preset", "tiny", "--output_dir", "/tmp/x", *(s for k, v in flags.items() for s in (f"--{k}", v))]
    (cli_model, _, cli_training), _ = parser.parse(argv)
    assert (training.num_train_epochs, training.max_steps, training.learning_rate) == (2.0, 10, 1e-4)
    assert model.freeze_vision_model is cli_model.freeze_vision_model is True
    assert training.to_dict() == cli_training.to_dict()


def test_within_a_cli_command_the_messages_keep_the_flags():
    with cli_wording(), pytest.raises(vlfit.ConfigError, match=r"^unknown --backend 'tensorrt'"):
        vlfit.load("clip-tiny", backend="tensorrt")
