"""The embedding index: ``store`` (the manifest, the shards and the one reader of them), ``build`` (embedding a
collection into shards: local files, dataset splits, tar shards at URLs, several processes), ``ann_choice`` (which
faiss structure fits a memory budget), ``ann`` (building, tuning, saving and searching it), ``ann_update`` (keeping
an index's ANN structure in step with its shards) and ``search`` (the one search of an index, returning ``Hit``s).
"""
