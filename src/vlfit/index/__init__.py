"""The embedding index: ``store`` (the manifest, the shards and reading them), ``ann`` (faiss structures, chosen
by a memory budget and a target recall), ``ann_update`` (keeping an index's ANN structure in step with its shards)
and ``search`` (the one search of an index, returning ``Hit``s).
"""
