"""``vlfit merge``: one model from fine-tuned runs of one base, without training (WiSE-FT's mix with the base, a
uniform or greedy soup, Model Stock). ``vlfit search --soup`` makes its soup here too. (Not ``vlfit/merge/``: a
subpackage of that name, once imported, would hide the API's ``vlfit.merge`` function.)

- ``runs``: ``merge_runs``, the whole merge: the runs loaded and checked (``vlfit.models.soups``), scored, merged
  and saved;
- ``methods``: what each method needs (refused before anything loads) and the merged weights it makes;
- ``scoring``: the runs' held-out scores, evaluated as ``vlfit eval`` does or as each run recorded them;
- ``folder``: the merged folder, saved as a run is, with its card and ``merge.json``.
"""
