"""A DataTable that is updated in place, so a refresh never moves the user's cursor or scroll.

Rebuilding a table on every stats snapshot (clear, then add every row) puts the cursor
back on the first row and scrolls to the top, once a second. Here each row has a stable
key (a tenant id, a backend name): a refresh adds the new rows, rewrites only the cells
that changed, removes the rows that went away, reorders with `DataTable.sort`, and puts
the cursor back on the row it was on, wherever that row now is.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual.coordinate import Coordinate
from textual.widgets import DataTable


@dataclass
class KeyedRow:
    key: str
    # Text, never str: DataTable reads a str cell as markup, and these come off the network.
    cells: list[Text]


class KeyedTable(DataTable):
    # (column key, title), in display order; added once, when the table is mounted.
    COLUMNS: list[tuple[str, str]] = []

    def on_mount(self) -> None:
        for key, title in self.COLUMNS:
            self.add_column(Text(title), key=key)

    def sync(self, rows: list[KeyedRow]) -> None:
        """Make the table show `rows`, in this order, changing only what differs."""
        on = self._cursor_key()
        # The first cell is copied so that its object is this row's alone (see _order).
        wanted = {row.key: [row.cells[0].copy(), *row.cells[1:]] for row in _unique(rows)}
        gone = [row_key for row_key in self.rows if row_key.value not in wanted]
        for row_key in gone:
            self.remove_row(row_key)
        for key, cells in wanted.items():
            if key in self.rows:
                self._update_row(key, cells)
            else:
                self.add_row(*cells, key=key)
        if gone and self.row_count:
            # Removing a row never narrows a column; measure them again.
            self.refit([column.key.value for column in self.ordered_columns])
        self._order(list(wanted))
        if on in wanted:
            # Scrolls only if the row moved out of sight; a row that stayed keeps the view.
            self.cursor_coordinate = Coordinate(self.get_row_index(on), self.cursor_column)

    def relabel(self, labels: dict[str, str]) -> None:
        """Give columns new titles, keeping the rows, the cursor and the scroll."""
        changed = [key for key, label in labels.items() if self.columns[key].label.plain != label]
        if not changed:
            return
        if not self.row_count:
            # Nothing to keep, and no cell whose update would redraw the header.
            self.clear(columns=True)
            for key, title in self.COLUMNS:
                self.add_column(Text(labels.get(key, title)), key=key)
            return
        for key in changed:
            self.columns[key].label = Text(labels[key])
        self.refit(changed)

    def refit(self, column_keys: list[str]) -> None:
        """Size columns to their widest cell or title again.

        Rewriting one cell with `update_width` makes DataTable measure the whole column
        whenever that cell is narrower than the column, and redraw the header.
        """
        first = self.ordered_rows[0].key
        for key in column_keys:
            self.update_cell(first, key, self.get_cell(first, key), update_width=True)

    def _cursor_key(self) -> str | None:
        if self.cursor_type != "row" or not self.row_count:
            return None
        return self.ordered_rows[self.cursor_row].key.value

    def _update_row(self, key: str, cells: list[Text]) -> None:
        for column, new in zip(self.ordered_columns, cells, strict=True):
            old = self.get_cell(key, column.key)
            if not _same(old, new):
                # A new width makes DataTable lay the table out again; skip that if it can.
                resized = not isinstance(old, Text) or old.cell_len != new.cell_len
                self.update_cell(key, column.key, new, update_width=resized)

    def _order(self, keys: list[str]) -> None:
        if [row.key.value for row in self.ordered_rows] == keys:
            return
        # DataTable.sort hands the key function cells, not row keys. Every row's first
        # cell is its own Text object, so that object's identity stands for the row.
        first = self.ordered_columns[0].key
        rank = {id(self.get_cell(key, first)): i for i, key in enumerate(keys)}
        self.sort(first, key=lambda cell: rank[id(cell)])


def _same(old: object, new: Text) -> bool:
    # Text's own == ignores the style and the justification, which carry meaning here.
    if not isinstance(old, Text):
        return False
    return (old.plain, old.style, old.justify, old.spans) == (
        new.plain,
        new.style,
        new.justify,
        new.spans,
    )


def _unique(rows: list[KeyedRow]) -> list[KeyedRow]:
    """The rows, with a repeated key (two backends of one name) made unique: `key#2`."""
    used: set[str] = set()
    unique = []
    for row in rows:
        key, n = row.key, 1
        while key in used:
            n += 1
            key = f"{row.key}#{n}"
        used.add(key)
        unique.append(KeyedRow(key, row.cells))
    return unique
