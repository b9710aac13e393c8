"""vlfit from Python: load a model and embed, train, evaluate, and build or query an index.

    import vlfit

    model = vlfit.load("runs/demo/model")
    images = model.encode_images(["cat.jpg", pil_image, jpeg_bytes, uint8_array])   # [4, D] float32, L2-normalized
    texts = model.encode_texts(["a cat", "a dog"])                                   # [2, D]
    scores = model.similarity(["cat.jpg"], ["a cat", "a dog"])                       # [1, 2] cosines

    result = vlfit.train(model_preset="clip-tiny", dataset_name="data/", output_dir="runs/x", max_steps=10)
    result.metrics["train_loss"], result.output_dir

Every function takes the flags of the matching CLI command as keyword arguments (``vlfit.train(learning_rate=1e-4)``
is ``vlfit train --learning_rate 1e-4``), converted and checked as the command line's are (``max_steps="10"`` is
10, ``max_steps="ten"`` is refused), before anything is loaded or written. A mistake raises a ``vlfit.UserError``
naming the keyword argument (``learning_rate=``): an unknown keyword or a value of the wrong type is an
``ArgumentError`` (also a ``TypeError``), with the closest keywords (``did you mean `precision=`?``).
"""

from vlfit.api.index import Index, SearchHit
from vlfit.api.model import Model, load
from vlfit.api.runs import RunResult, evaluate, merge, train

__all__ = ["Index", "Model", "RunResult", "SearchHit", "evaluate", "load", "merge", "train"]
