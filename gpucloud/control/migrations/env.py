"""Alembic environment: runs online against the engine `db.upgrade` hands over.

SQLite alters a table by copying it and dropping the old one, which its foreign keys
forbid while other rows refer to it (a replica's usage rows): on SQLite the migrations run
with foreign keys off, and the upgrade fails if they left a reference dangling."""

from alembic import context
from sqlalchemy import text

from gpucloud.control.models import Base

engine = context.config.attributes["engine"]
sqlite = engine.dialect.name == "sqlite"
with engine.connect() as connection:
    if sqlite:  # outside a transaction (which the driver's own connection is not in yet)
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=OFF")
    with connection.begin():
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=True,  # SQLite alters tables by copying them
        )
        with context.begin_transaction():
            context.run_migrations()
        if sqlite:
            dangling = connection.execute(text("PRAGMA foreign_key_check")).all()
            if dangling:
                raise RuntimeError(f"the migration left rows referring to nothing: {dangling}")
    if sqlite:
        connection.connection.driver_connection.execute("PRAGMA foreign_keys=ON")
