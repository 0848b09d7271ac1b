"""One file per revision, named ``NNNN_what.py``; Alembic ignores this file."""
