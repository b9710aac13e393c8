"""``vlfit vqa``: answers to questions about an image, with their scores, from a ``--task vqa`` model."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass

from vlfit.arguments.runtime import runtime_arguments
from vlfit.commands.parsing import CommandParser
from vlfit.errors import ConfigError, DataError, MissingFileError
from vlfit.flags import flag


@dataclass
class VqaArguments(runtime_arguments("num_threads", "max_seq_length")):
    """Flags of ``vlfit vqa`` (the image and the question are positional arguments)."""

    model: str = flag(help="A model folder vlfit train --task vqa saved.")
    questions: str | None = flag(
        None,
        "A file of questions instead of one on the command line: one question per line about IMAGE, or "
        "JSON lines with 'question' and 'image' (a path; default IMAGE).",
    )
    top_k: int = flag(3, "Answers printed per question, best first.")
    batch_size: int = flag(32, "Questions answered in one forward.")


def read_questions(path: str, image: str | None) -> list[tuple[str, str]]:
    """``(image, question)`` pairs of a ``--questions`` file (see ``VqaArguments.questions``)."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = [line.strip() for line in file if line.strip()]
    except OSError as error:
        raise MissingFileError(f"--questions {path}: {error.strerror}") from error
    pairs = []
    for number, line in enumerate(lines, start=1):
        if line.startswith("{"):
            row = json.loads(line)
            question, where = row.get("question"), row.get("image", image)
        else:
            question, where = line, image
        if not isinstance(question, str) or not question.strip():
            raise DataError(f"--questions {path}, line {number}: no question")
        if where is None:
            raise DataError(f"--questions {path}, line {number}: no image (give IMAGE or an 'image' key)")
        pairs.append((where, question))
    return pairs


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``vlfit vqa``: one line per answer, ``question<TAB>answer<TAB>score``."""
    parser = CommandParser(
        VqaArguments,
        prog="vlfit vqa",
        description="Answer questions about images with a BridgeTower model fine-tuned by vlfit train --task vqa: "
        "vlfit vqa --model RUN IMAGE 'question', or --questions FILE.",
    )
    parser.add_argument("image", nargs="?", help="The image file the question is about.")
    parser.add_argument("question", nargs="?", help="The question.")
    args, extra = parser.parse_args_into_dataclasses(args=sys.argv[1:] if argv is None else argv)
    for option, value in (("--top_k", args.top_k), ("--batch_size", args.batch_size)):
        if value < 1:
            raise ConfigError(f"{option} must be at least 1, got {value}")
    if args.questions is not None:
        if extra.question is not None:
            raise ConfigError("give a question on the command line or --questions FILE, not both")
        pairs = read_questions(args.questions, extra.image)
    elif extra.image is None or extra.question is None:
        raise ConfigError("give an IMAGE and a question (vlfit vqa --model RUN IMAGE 'question'), or --questions FILE")
    else:
        pairs = [(extra.image, extra.question)]
    for image in dict.fromkeys(image for image, _ in pairs):  # every image there before the model loads
        if not os.path.isfile(image):
            raise MissingFileError(f"{image}: no such image file")
    from vlfit.inference.runtime import ModelRuntime

    runtime = ModelRuntime.open(args.model, args.settings())
    questions = [question for _, question in pairs]
    answered = runtime.answer([image for image, _ in pairs], questions, args.top_k, args.batch_size)
    for question, answers in zip(questions, answered, strict=True):
        for answer, score in answers:
            print(f"{question}\t{answer}\t{score:.4f}")
    return 0
