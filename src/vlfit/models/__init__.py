"""Models: what a model name refers to (``reference``), the family interface and one module per family, the
registry, presets as JSON files, loading (a ``ModelSpec``, then a ``LoadedModel``) and tokenizers."""
