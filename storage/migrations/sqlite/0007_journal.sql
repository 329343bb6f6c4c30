CREATE TABLE IF NOT EXISTS journal_ingests (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    accepted_at REAL NOT NULL,
    node TEXT NOT NULL,
    file TEXT NOT NULL,
    facts TEXT NOT NULL,
    body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS journal_ingests_by_time ON journal_ingests (accepted_at);
CREATE TABLE IF NOT EXISTS journal_held (
    node TEXT NOT NULL,
    entity TEXT NOT NULL,
    kind TEXT NOT NULL,
    code TEXT NOT NULL,
    held_at REAL NOT NULL,
    hold_until REAL NOT NULL,
    source TEXT NOT NULL,
    finding TEXT NOT NULL,
    PRIMARY KEY (node, entity, kind, code)
);
