"""Run one door in this process and print, as JSON, how often each file of the model and index folders was opened
(``python count_opens.py query|serve INDEX MODEL``; used by ``test_runtime_opens.py``).

An audit hook sees every ``open``. An open is counted against vlfit when the code that asked for it is vlfit's, or
when it reads the weights or an index file; transformers' own loaders read their JSON files more than once inside
one ``from_pretrained`` call (the tokenizer's config three times), which no caller can change.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import sysconfig

WATCHED = ("vlfit" + os.sep, "transformers" + os.sep)
STDLIB = sysconfig.get_paths()["stdlib"]


def main() -> None:
    door, index, model = sys.argv[1:4]
    roots = {"index": os.path.realpath(index), "model": os.path.realpath(model)}
    counts: dict[str, collections.Counter] = {"all": collections.Counter(), "vlfit": collections.Counter()}

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not isinstance(args[0], (str, bytes, os.PathLike)):
            return
        path = os.path.realpath(os.fsdecode(args[0]))
        if not any(path.startswith(root + os.sep) for root in roots.values()):
            return
        counts["all"][path] += 1
        frame = sys._getframe(1)
        while frame is not None and (frame.f_code.co_filename.startswith(STDLIB) or "<" in frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None and os.sep + "vlfit" + os.sep in frame.f_code.co_filename:
            counts["vlfit"][path] += 1

    sys.addaudithook(hook)
    if door == "query":
        from vlfit.cli import main as cli

        assert cli(["retrieve", "query", "--index", index, "--text", "a red circle", "-k", "2"]) == 0
    else:
        from fastapi.testclient import TestClient

        from vlfit.commands.serve import ServeArguments, build_app

        with TestClient(build_app(ServeArguments(index=index)), base_url="http://127.0.0.1") as client:
            for text in ("a red circle", "two blue squares"):  # the second query opens nothing more
                answer = client.post("/api/search", json={"text": text, "k": 2})
                assert answer.status_code == 200, answer.text
    print(json.dumps({name: dict(counter) for name, counter in counts.items()}))


if __name__ == "__main__":
    main()
