"""Each schema's DDL is written twice by hand, once per dialect (SQLite and
PostgreSQL): migrated to the code's version, the two must end up with the
same tables, columns, keys, indexes and references, so that a store moved
from one host to several (or back) means the same rows."""

from __future__ import annotations

import re

import pytest

from blockdiff.db import Migrations, connect, migrate, open_database

# The schema each group is given on PostgreSQL, as its users open it.
GROUPS = {"catalog": "catalog", "agent": "agent", "langgraph": "langgraph"}

# Where the dialects differ on purpose, and why (each checked to be so; any
# other difference fails).
ONLY_ON_SQLITE = {
    # The legacy marker older blockdiffs read, kept in step (blockdiff.db.migrations).
    ("catalog", "schema_migrations"): "table",
    # A table of counters on SQLite; a SEQUENCE on PostgreSQL, whose nextval
    # never waits for another transaction (blockdiff/store/catalog.py).
    ("catalog", "generations"): "sequence",
}
TYPES_DIFFER = {
    # SQLite keeps JSON text in the clear and sealed bytes in one column;
    # PostgreSQL keeps bytes, the codec's PLAIN prefix marking those in the
    # clear (blockdiff/agent/model.py).
    ("agent", "checkpoints", "meta"): ("text", "bytes"),
}

# Types by family: what a column holds, not how each dialect spells it.
FAMILIES = [(r"int|serial", "integer"), (r"text|char|clob", "text"),
            (r"real|double|float|numeric", "real"), (r"blob|bytea", "bytes"),
            (r"bool", "integer")]


def family(declared: str) -> str:
    for pattern, name in FAMILIES:
        if re.search(pattern, declared, re.I):
            return name
    raise AssertionError(f"a column type no family covers: {declared!r}")


def schema_group(name: str) -> Migrations:
    if name == "catalog":
        from blockdiff.store.catalog import SCHEMA
    elif name == "agent":
        from blockdiff.agent.model import SCHEMA
    else:
        pytest.importorskip("langgraph")
        from blockdiff.agent.langgraph import SCHEMA
    return SCHEMA


def sqlite_shape(db) -> dict:
    shape = {}
    for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                               "AND name NOT LIKE 'sqlite_%'").fetchall():
        columns = db.execute(f'PRAGMA table_info("{table}")').fetchall()
        key = tuple(name for _, name, *_, pk in sorted(columns, key=lambda c: c[5]) if pk)
        indexes = set()
        for _, index, unique, origin, partial in db.execute(
                f'PRAGMA index_list("{table}")').fetchall():
            if origin == "pk":
                continue
            cols = tuple(r[2] for r in db.execute(f'PRAGMA index_info("{index}")').fetchall())
            indexes.add((cols, bool(unique), bool(partial)))
        references = {(row[3], row[2], row[4] or "") for row in
                      db.execute(f'PRAGMA foreign_key_list("{table}")').fetchall()}
        shape[table] = {
            # An INTEGER PRIMARY KEY is the rowid: never null, as any key is in PostgreSQL.
            "columns": [(name, family(kind), bool(notnull) or name in key)
                        for _, name, kind, notnull, _default, _pk in columns],
            "key": key, "indexes": indexes, "references": references}
    return shape


def postgresql_shape(db) -> dict:
    shape = {}
    for (table,) in db.execute("SELECT tablename FROM pg_tables "
                               "WHERE schemaname = current_schema()").fetchall():
        columns = db.execute(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = ? "
            "ORDER BY ordinal_position", (table,)).fetchall()
        constraints = db.execute(
            "SELECT c.contype, ARRAY(SELECT a.attname FROM unnest(c.conkey) WITH ORDINALITY "
            "  AS k(n, i) JOIN pg_attribute a ON a.attrelid = c.conrelid AND a.attnum = k.n "
            "  ORDER BY k.i), c.confrelid::regclass::text, "
            "  ARRAY(SELECT a.attname FROM unnest(c.confkey) WITH ORDINALITY AS k(n, i) "
            "  JOIN pg_attribute a ON a.attrelid = c.confrelid AND a.attnum = k.n ORDER BY k.i) "
            "FROM pg_constraint c WHERE c.conrelid = ?::regclass", (table,)).fetchall()
        key = next((tuple(cols) for kind, cols, _, _ in constraints if kind == "p"), ())
        # SQLite keeps a UNIQUE constraint as an index; PostgreSQL as a constraint.
        indexes = {(tuple(cols), True, False) for kind, cols, _, _ in constraints if kind == "u"}
        for (definition,) in db.execute(
                "SELECT i.indexdef FROM pg_indexes i WHERE i.schemaname = current_schema() "
                "AND i.tablename = ? AND i.indexname NOT IN (SELECT conname FROM pg_constraint "
                "WHERE conrelid = ?::regclass)", (table, table)).fetchall():
            cols = re.search(r" USING \w+ \(([^)]*)\)", definition).group(1)
            indexes.add((tuple(c.strip().strip('"').split()[0] for c in cols.split(",")),
                         definition.startswith("CREATE UNIQUE"), " WHERE " in definition))
        references = set()
        for kind, cols, target, target_cols in constraints:
            if kind == "f":
                for i, col in enumerate(cols):
                    target_col = target_cols[i] if target_cols else ""
                    references.add((col, target.rsplit(".", 1)[-1], target_col))
        shape[table] = {
            "columns": [(name, family(kind), nullable == "NO" or name in key)
                        for name, kind, nullable in columns],
            "key": key, "indexes": indexes, "references": references}
    return shape


def _with_named_references(shape: dict) -> dict:
    """SQLite records a reference to a table's key without the column when
    the DDL omits it; name the key column, as PostgreSQL does."""
    for table in shape.values():
        table["references"] = {
            (col, target, target_col or (shape[target]["key"] or ("rowid",))[0])
            for col, target, target_col in table["references"]}
    return shape


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_both_dialects_make_the_same_tables(group, tmp_path, postgres_url):
    schema = schema_group(group)
    lite = connect(tmp_path / "lite.sqlite", create="new")
    server = open_database(postgres_url, schema=GROUPS[group])
    try:
        migrate(lite, schema)
        migrate(server, schema)
        server_sequences = server.execute(
            "SELECT sequencename FROM pg_sequences WHERE schemaname = current_schema()"
            " AND sequencename NOT LIKE '%_seq'").fetchall()
        ours, theirs = (_with_named_references(sqlite_shape(lite)),
                        _with_named_references(postgresql_shape(server)))
    finally:
        lite.close()
        server.close()
    sequences = {name for (name,) in server_sequences}
    for (where, table), instead in ONLY_ON_SQLITE.items():
        if where == group:
            assert table in ours and table not in theirs, (group, table)
            if instead == "sequence":
                assert table in sequences, f"{group}: no sequence {table} on PostgreSQL"
            del ours[table]
    for (where, table, column), (lite_type, server_type) in TYPES_DIFFER.items():
        if where == group:
            for shape, kind, other in ((ours, lite_type, server_type),
                                       (theirs, server_type, lite_type)):
                columns = shape[table]["columns"]
                at = [c[0] for c in columns].index(column)
                assert columns[at][1] == kind, (group, table, columns[at])
                columns[at] = (column, "either", columns[at][2])
    assert set(ours) ^ set(theirs) == set(), (
        f"{group}: only on SQLite: {sorted(set(ours) - set(theirs))}; "
        f"only on PostgreSQL: {sorted(set(theirs) - set(ours))}")
    for table in ours:
        for part in ("columns", "key", "indexes", "references"):
            assert ours[table][part] == theirs[table][part], (
                f"{group}: table {table}'s {part} differ: SQLite {ours[table][part]} "
                f"against PostgreSQL {theirs[table][part]}")
