"""In-process stand-ins shared by the fast tests.

``state``: what ``cluster.state`` needs to build a site state without a bus.
``membus``: an in-memory site bus (``MemoryBus``) for trio's ``autojump_clock``.
Lab processes, namespaces and polling helpers live in ``tests/lab.py``.
"""
