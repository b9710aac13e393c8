"""Image classification from a handful of labelled images: zero-shot, a linear probe, and SetFit's recipe.

Modules, in the order ``vlfit fewshot`` uses them: ``shots`` (the few labelled images per class, the same for every
method), ``heads`` (linear classifiers on embeddings: zero-shot, logistic regression), ``setfit`` (contrastive
fine-tuning of the image tower on pairs of the shots), ``experiment`` (every method over shot counts and seeds),
``report`` (``fewshot.json``/``.md``/``.png``), ``classifier`` (a saved model and head, what ``vlfit classify`` runs).
The labelled splits (a dataset split with a class column) and the zero-shot prompts are evaluation code, a layer
below: ``vlfit.data.sources.labelled`` and ``vlfit.evaluation.zeroshot``.
"""
