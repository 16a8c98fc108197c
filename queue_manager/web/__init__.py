"""The web dashboard (``qm web``): every shard of a topology in one browser page (docs/dashboard.md).

Server-rendered with Starlette and Jinja2, live parts pushed as server-sent events to a small
static script, no JavaScript build step; it
needs the ``web`` extra (``pip install queue-manager[web]``). Nothing in the core imports it.
"""
