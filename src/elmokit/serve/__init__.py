"""`elmo serve`: ELMo's vectors over HTTP (OpenAI's and TEI's routes), dynamic batching with a
token budget, limits, an API key, Prometheus metrics, and a page to explore the vectors.

    app.py       the routes, the errors, the API key (Starlette)
    batching.py  the queue that embeds requests arriving together in one batch
    inputs.py    what a body may hold, and the limits
    explore.py   the page's nearest occurrences and PCA pictures
    metrics.py   the Prometheus metrics
    static/      the page (HTML and JavaScript, no build step)

Needs the `serve` extra (starlette, uvicorn, httptools, prometheus_client, orjson, sacremoses).
"""
