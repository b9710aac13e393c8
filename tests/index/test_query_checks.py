"""What ``vlfit retrieve query`` refuses before the index and the model open."""

from __future__ import annotations

import pytest

from vlfit.commands.retrieve_queries import Query, check_queries
from vlfit.errors import DataError, MissingFileError


def test_a_text_query_of_bytes_that_are_not_utf8_is_refused_naming_it():
    # Python hands command-line bytes that are not UTF-8 over as lone surrogates (surrogateescape): b"a \xff b".
    text = b"a \xff b".decode("utf-8", "surrogateescape")
    with pytest.raises(DataError, match=r"^text query 2 is not valid Unicode text: a lone surrogate \(U\+DCFF"):
        check_queries([Query(text="fine"), Query(text=text)])


def test_a_missing_image_query_is_refused_naming_the_file(tmp_path):
    with pytest.raises(MissingFileError, match="--image .*nope.jpg: no such file"):
        check_queries([Query(text="fine"), Query(image=str(tmp_path / "nope.jpg"))])
