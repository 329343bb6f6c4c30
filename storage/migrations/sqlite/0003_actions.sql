CREATE TABLE IF NOT EXISTS actions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    key TEXT NOT NULL UNIQUE,
    incident TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    node TEXT NOT NULL,
    entity TEXT NOT NULL,
    step TEXT NOT NULL,
    reason TEXT NOT NULL,
    attrs TEXT NOT NULL,
    dry_run INTEGER NOT NULL,
    severity TEXT NOT NULL,
    phase TEXT NOT NULL,
    ref TEXT NOT NULL DEFAULT '',
    adapter TEXT NOT NULL DEFAULT '',
    message TEXT NOT NULL DEFAULT '',
    created_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    updated_at REAL NOT NULL,
    not_before REAL,
    decided_by TEXT NOT NULL DEFAULT '',
    epoch TEXT NOT NULL DEFAULT ''
);
CREATE INDEX IF NOT EXISTS actions_phase ON actions (phase);
CREATE INDEX IF NOT EXISTS actions_incident ON actions (incident);
CREATE TABLE IF NOT EXISTS incidents (
    incident TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    node TEXT NOT NULL,
    entity TEXT NOT NULL,
    kind TEXT NOT NULL,
    code TEXT NOT NULL,
    severity TEXT NOT NULL,
    state TEXT NOT NULL,
    opened_at REAL NOT NULL,
    out_of_service_at REAL,
    fixed_at REAL,
    probation_until REAL,
    closed_at REAL,
    claimed INTEGER NOT NULL DEFAULT 1,
    note TEXT NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS control (
    name TEXT PRIMARY KEY,
    value TEXT NOT NULL,
    at REAL NOT NULL,
    who TEXT NOT NULL DEFAULT '',
    why TEXT NOT NULL DEFAULT ''
);
