"""Logging is configured by the CLI entry point only: library modules log to their own loggers, nothing else."""

import contextlib
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

import vlfit
from vlfit.cli import take_log_level
from vlfit.logs import configure_logging, configure_third_parties, quiet_third_parties


@contextlib.contextmanager
def transformers_messages() -> Iterator[list[str]]:
    """The messages transformers logs meanwhile (those its loggers' filters let through), from the library's
    defaults (nothing hidden), to which it returns after."""
    import transformers

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    quiet_third_parties(False)
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        transformers.utils.logging.set_verbosity_warning()
        quiet_third_parties(False)


def test_no_library_module_configures_logging():
    """Only vlfit.logs (called by the CLI's entry point) adds handlers or calls basicConfig; every other module just
    logs to getLogger(__name__)."""
    package = Path(vlfit.__file__).parent
    configuring = re.compile(r"logging\.basicConfig|\.addHandler\(|StreamHandler\(|getLogger\([\"']vlfit")
    offenders = [
        f"{path.relative_to(package)}:{number}"
        for path in sorted(package.rglob("*.py"))
        if path.name != "logs.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if configuring.search(line)
    ]
    assert offenders == []


def test_the_cli_takes_log_level_anywhere_and_refuses_an_unknown_one(capsys):
    assert take_log_level(["--output_dir", "x", "--log_level", "warning"]) == (["--output_dir", "x"], "warning")
    assert take_log_level(["--log_level=debug", "a"]) == (["a"], "debug")
    assert take_log_level(["a"]) == (["a"], "info")
    with pytest.raises(SystemExit):
        take_log_level(["--log_level", "loud"])
    assert "--log_level 'loud'" in capsys.readouterr().err


def test_configure_logging_installs_one_handler_on_vlfit_at_the_level():
    package = logging.getLogger("vlfit")
    before = list(package.handlers)
    try:
        configure_logging("warning")
        configure_logging("debug")
        added = [h for h in package.handlers if h not in before]
        assert len(added) == 1 and package.level == logging.DEBUG
    finally:
        for handler in package.handlers[:]:
            if handler not in before:
                package.removeHandler(handler)
        package.setLevel(logging.NOTSET)


QUIET_CHILD = """
import logging, sys
from vlfit.logs import configure_logging
from vlfit.models.loading import load_model
captions = ["two red circles on the left", "one green cross in the center", "three yellow triangles"] * 20
configure_logging("info")
load_model(model_preset="siglip-tiny", captions=lambda: captions).save(sys.argv[1])
for level in ("info", "debug"):
    logging.Logger.warning_once.cache_clear()  # transformers says each warning once per process
    configure_logging(level)
    print(f"--- {level}", file=sys.stderr, flush=True)
    load_model(model_name_or_path=sys.argv[1])
    sys.stderr.flush()
"""


@pytest.mark.slow
def test_loading_a_checkpoint_shows_transformers_bars_and_token_id_warnings_at_debug_only(tmp_path):
    """A SigLIP checkpoint's load drew a "Loading weights" bar and warned about its config's bos/eos ids, every
    time; the CLI hides both unless --log_level debug. A process of its own: transformers' handler and bars write
    to the stderr of the process that first configured them."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", QUIET_CHILD, str(tmp_path / "siglip")], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == ""
    at_info, at_debug = done.stderr.split("--- info")[1].split("--- debug")
    for shown in ("Loading weights", "bos_token_id must be"):
        assert shown not in at_info and shown in at_debug


def test_the_cli_hides_a_load_report_of_unexpected_keys_only_and_the_token_alignment_note_but_not_missing_keys():
    """transformers' records as the CLI shows them at info (and all of them at debug): a load report listing only
    UNEXPECTED keys (a CLIP checkpoint's text tower, left out when it is a two-tower run's vision tower) and the
    Trainer's PAD/BOS/EOS alignment note say nothing a user can act on; weights started afresh (MISSING) are news."""
    from transformers import CLIPVisionConfig, CLIPVisionModel
    from transformers.trainer_utils import logger as trainer_logger
    from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report

    model = CLIPVisionModel(CLIPVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=8, patch_size=4))  # fmt: skip
    unexpected = LoadStateDictInfo(set(), {"text_model.final_layer_norm.weight", "logit_scale"}, set(), [], {}, set())
    missing = LoadStateDictInfo({"vision_model.post_layernorm.weight"}, {"logit_scale"}, set(), [], {}, set())
    modeling_logger = logging.getLogger("transformers.modeling_utils")
    shown = {}
    for level in ("info", "debug"):
        with transformers_messages() as messages:
            configure_third_parties(level)
            for info in (unexpected, missing):
                log_state_dict_report(model, "runs/clip", False, info, logger=modeling_logger)
            trainer_logger.warning(
                "The tokenizer has new PAD/BOS/EOS tokens that differ from the model config and "
                "generation config. ... Updated tokens: {'eos_token_id': 4, 'bos_token_id': 0}."
            )
        shown[level] = messages
    assert len(shown["debug"]) == 3
    assert len(shown["info"]) == 1 and "MISSING" in shown["info"][0]


def test_a_progress_bar_left_open_ends_its_line_before_a_message():
    """A bar a stop left open mid-line is closed first, so the one-line message printed after starts a line."""
    import io

    from tqdm.auto import tqdm

    from vlfit.logs import end_progress_bars

    stream = io.StringIO()
    kept, cleared = tqdm(total=10, desc="Generating train", file=stream), tqdm(total=5, leave=False, file=stream)
    kept.update(3)
    end_progress_bars()
    assert kept.disable and cleared.disable  # closed
    assert stream.getvalue().endswith("\n")
