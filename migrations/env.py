"""Alembic environment. kvgate runs migrations on its own async engine (gateway.db.migrate),
which hands a connection in through `config.attributes`."""

from alembic import context

from gateway.db.tables import Base

config = context.config
target_metadata = Base.metadata


def run_with(connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
    )
    with context.begin_transaction():
        context.run_migrations()


connection = config.attributes.get("connection")
if connection is None:
    raise RuntimeError("run migrations with `kvgate db upgrade`, which supplies the connection")
run_with(connection)
