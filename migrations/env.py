"""Alembic environment for the service's own tables (``autotune_*``).

One source of truth: the models are ``api.db.Base.metadata``, the database URL is the
app's (`Settings().db_url`, i.e. AUTOTUNE_DB_URL), unless the caller passes a connection in
``config.attributes["connection"]`` (what `api.db.upgrade_schema` and `autotune db ...`
do) or a URL with ``alembic -x db=URL``.

The version table is ``autotune_alembic_version``: Optuna's RDB schema in the same database
uses the default ``alembic_version``. Reflection and autogenerate see only ``autotune_*``
tables, so Optuna's tables are never diffed, altered or dropped. SQLite runs in batch mode
(ALTER TABLE by copy). Developers add a revision with
``alembic revision --autogenerate -m "what"`` from the repository root (alembic.ini).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Connection
from sqlalchemy.engine import make_url

from autotune.api.db import migration_connection, migration_options
from autotune.api.settings import Settings

config = context.config


def database_url() -> str:
    return context.get_x_argument(as_dictionary=True).get("db") or config.get_main_option("sqlalchemy.url") \
        or Settings().db_url


def run_migrations(connection: Connection) -> None:
    context.configure(connection=connection, **migration_options(connection.dialect.name))
    with context.begin_transaction():
        context.run_migrations()


def run_offline() -> None:
    """`alembic upgrade --sql`: print the SQL instead of running it."""
    url = database_url()
    context.configure(url=url, literal_binds=True, dialect_opts={"paramstyle": "named"},
                      **migration_options(make_url(url).get_backend_name()))
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        run_migrations(connection)
        return
    with migration_connection(database_url()) as connection:  # the same lock the service takes
        run_migrations(connection)


if context.is_offline_mode():
    run_offline()
else:
    run_online()
