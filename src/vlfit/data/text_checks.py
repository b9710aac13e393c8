"""What a text must be before it is tokenized, checked once for every door: ``vlfit.load(...).encode_texts`` and the
other API calls that take texts (``vlfit.api.model.text_list``) and the server's routes
(``vlfit.serve.json_body.text_problem``) refuse with the same words.

A Python ``str`` may hold a lone surrogate (``"\\ud800"``: half of a UTF-16 pair, which JSON's ``\\ud800`` escape and
a file name that is not UTF-8 both make). It is no Unicode text: UTF-8 cannot encode it and the tokenizers refuse it
with a ``TypeError`` of their own.
"""

from __future__ import annotations


def unicode_problem(text: str, field: str) -> str | None:
    """Why ``text`` (named ``field`` in the message: ``texts[0]``) is not valid Unicode text; None when it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:  # what UTF-8 cannot encode of a str: a surrogate code point alone
        return (
            f"{field} is not valid Unicode text: a lone surrogate (U+{ord(text[err.start]):04X}, half of a UTF-16 "
            f"pair) at character {err.start}, which no tokenizer takes"
        )
    return None


__all__ = ["unicode_problem"]
