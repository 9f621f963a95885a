"""In-process stand-ins shared by the fast tests.

``state``: what ``cluster.state`` needs to build a site state without a bus.
``membus``: an in-memory site bus (``MemoryBus``, ``open_memory_member``) and
``MemorySite``, site members on it (the ``memory_site`` fixture of
tests/conftest.py), for tests under trio's ``autojump_clock``.
Lab processes, namespaces and polling helpers live in tests/lab.py.
"""
