"""The records a model folder holds beside its weights (``input_spec.json``, ``rerank.json``) are read by one
reader: a missing one is None, one that is not JSON or of a newer format is refused in one line naming the file."""

from __future__ import annotations

import json
import re

import pytest

from vlfit.errors import ModelLoadError
from vlfit.inference.rerank_score import RERANK_FILE, read_rerank_file, save_rerank_file
from vlfit.models.input_spec_file import INPUT_SPEC_FILE, read_input_settings


def test_a_folder_without_a_record_reads_none_and_a_saved_one_reads_back(tmp_path):
    assert read_rerank_file(str(tmp_path)) is None and read_input_settings(None) is None
    path = save_rerank_file(str(tmp_path), {"rerank_weight": 2.0})
    assert path == str(tmp_path / RERANK_FILE)
    saved = {"format_version": 1, "rerank_weight": 2.0}
    assert (tmp_path / RERANK_FILE).read_text() == json.dumps(saved, indent=2) + "\n"
    assert read_rerank_file(str(tmp_path)) == saved


@pytest.mark.parametrize(
    ("file_name", "read", "unreadable", "newer"),
    [
        (RERANK_FILE, read_rerank_file, "cannot read the saved re-ranking weight (",
         "a re-ranking record of an unknown format; upgrade vlfit to read it"),
        (INPUT_SPEC_FILE, read_input_settings, "cannot read the run's input settings (",
         "input settings of an unknown format; upgrade vlfit to load this model"),
    ],
)  # fmt: skip
def test_a_record_that_is_not_json_or_is_newer_is_refused_naming_its_file(tmp_path, file_name, read, unreadable, newer):
    path = tmp_path / file_name
    path.write_text("{not json")
    with pytest.raises(ModelLoadError, match=f"^{re.escape(f'{path}: {unreadable}')}"):
        read(str(tmp_path))
    for record in ({"format_version": 2, "rerank_weight": 1.0, "max_seq_length": 16}, [1]):
        path.write_text(json.dumps(record))
        with pytest.raises(ModelLoadError, match=f"^{re.escape(f'{path}: {newer}')}$"):
            read(str(tmp_path))
