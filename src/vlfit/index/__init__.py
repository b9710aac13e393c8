"""The embedding index: ``store`` (the manifest and the shards), ``shard_vectors`` (the one reader of the shard files),
``integrity`` and ``verify`` (the files checked against what the manifest records, and an index opened only when
whole), ``build`` (embedding a collection into shards: local files, dataset splits, tar shards at URLs, several
processes), ``ann_choice`` (which faiss structure fits a memory budget), ``ann`` (building, tuning, saving and
searching it), ``ann_update`` (keeping an index's ANN structure in step with its shards) and ``search`` (the one
search of an index, returning ``Hit``s).
"""
