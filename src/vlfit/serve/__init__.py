"""``vlfit serve``: an index and its model as a search engine over HTTP, with a web page.

Modules, in the order a request meets them: ``app`` (the ASGI routes, the upload limit, the web page), ``batching``
(concurrent text queries collected into one encoder batch), ``engine`` (the model and the served index snapshot:
search, thumbnails, atomic reloads), ``metrics`` (Prometheus counters and latency histograms).
"""
