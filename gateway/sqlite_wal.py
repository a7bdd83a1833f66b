"""The SQLite write-ahead log's size limit, in a module of its own: gateway.config (read
by every `kvgate` command) takes it as a setting's default, and importing it from the
database layer cost `kvgate worker`, `top`, `bench` and `chat` SQLAlchemy's import
(about 0.4 CPU-s) for a database they never open."""

# the WAL file's size past which a checkpoint truncates it (Settings.sqlite_wal_limit_bytes)
SQLITE_WAL_LIMIT_BYTES = 16 * 2**20
