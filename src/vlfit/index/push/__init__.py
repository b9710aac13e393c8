"""Indexes in vector databases: ``push_index`` writes an index to one (``vlfit retrieve push``), ``PushedIndex``
searches what was pushed (``vlfit retrieve query --index URI``); ``vlfit.index.push.base`` defines the target URIs
and the interface each engine's module implements."""
