"""Alembic migrations of the service's own tables (``autotune_*``); see env.py.

A package only so that it is installed next to ``api`` (api/db.py finds it there);
nothing imports it.
"""
