"""``vlfit serve``: an index and its model as a search engine over HTTP, with a web page.

Modules, in the order a request meets them: ``connections`` (uvicorn's HTTP protocol with a connection cap, a
request-head timeout and size limit), ``middleware`` (requests in flight, body size and time, HEAD, metrics),
``app`` (the ASGI routes and the web page), ``queries`` (a request checked before anything is computed),
``batching`` (concurrent text queries collected into one encoder batch), ``images`` (query images and thumbnails,
bounded before they decode), ``engine`` (the model and the served index snapshot: search, atomic reloads),
``metrics`` (Prometheus counters and latency histograms); ``limits`` holds every bound's default.
"""
